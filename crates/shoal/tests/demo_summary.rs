//! What `shoal demo`'s summary tells an operator about slices it cut: a builder whose
//! wall-clock guard is shorter than the delay some sources add on purpose processes every
//! slice without them, and the summary names those sources and says they were sending.

mod common;

#[test]
fn slices_cut_at_the_wall_clock_guard_name_the_sources_that_were_behind() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("guard.toml");
    // delayed:8 sends sources 8-15 one slice (10 ms) after sources 0-7: a 1-ms guard
    // processes each slice before their fragments come.
    std::fs::write(&cfg, "[builder]\nwall_timeout_ms = 1\n").unwrap();
    let out = common::shoal()
        .args(["demo", "--sources", "16", "--builders", "2", "--policy", "delayed:8", "--seconds", "1", "--config"])
        .arg(&cfg)
        .arg("--out")
        .arg(dir.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("(balanced)"), "{stdout}");
    let warning = stdout
        .lines()
        .find(|l| l.contains("wall-clock guard"))
        .unwrap_or_else(|| panic!("no warning about the wall-clock guard:\n{stdout}"));
    assert!(warning.contains("slices were processed incomplete"), "{warning}");
    // Named most slices first: the first group is delayed sources, missing from more
    // slices than any source on time (which a busy machine may delay now and then).
    let named = warning.split("most often missing: sources ").nth(1).unwrap_or_else(|| panic!("{warning}"));
    // "8-15 (100 slices), 4 (1 slice) and 1 more. ...": ids, then their count.
    let list = named.split(". ").next().unwrap();
    let groups: Vec<(std::ops::RangeInclusive<u32>, u64)> = list
        .split(", ")
        .map(|item| {
            let (range, rest) = item.split_once(" (").unwrap_or_else(|| panic!("{item} in {warning}"));
            let count: u64 = rest.split(' ').next().unwrap().parse().unwrap();
            let (a, b) = range.split_once('-').unwrap_or((range, range));
            (a.parse().unwrap()..=b.parse().unwrap(), count)
        })
        .collect();
    let (first, most) = &groups[0];
    assert!(first.start() >= &8 && first.end() < &16, "{groups:?} from {warning}");
    let on_time = groups.iter().filter(|(ids, _)| ids.start() < &8).map(|(_, n)| *n).max().unwrap_or(0);
    assert!(*most > on_time, "{groups:?} from {warning}");
    // Their fragments came after the slices were processed: they were sending.
    let later = common::number_after(warning, "In ")
        .unwrap_or_else(|| panic!("no count of slices whose fragments came later: {warning}"));
    assert!(later > 0 && warning.contains("every missing fragment came later"), "{warning}");
}
