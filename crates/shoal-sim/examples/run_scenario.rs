//! Runs a scenario file and prints its summary as JSON: `cargo run -p shoal-sim --release --example run_scenario FILE`.
fn main() {
    let path = std::env::args().nth(1).expect("scenario file");
    let sc = shoal_sim::scenario::Scenario::from_toml(&std::fs::read_to_string(path).unwrap()).unwrap();
    let r = shoal_sim::sim::run(&sc).unwrap();
    println!("{:#?}", r.summary);
}
