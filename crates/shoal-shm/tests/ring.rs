//! A publisher and consumers in one process (threads): every byte arrives in place, the
//! policies count what they should, and a consumer that goes away frees its slots.

use std::time::Duration;

use shoal_shm::{ConsumerOptions, Next, Policy, PublisherConfig, SliceConsumer, SlicePublisher};

fn name(tag: &str) -> String {
    format!("shoal-test/{}/{tag}", std::process::id())
}

fn payload(slice: u64, source: u32, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i as u64 * 31 + slice * 7 + source as u64) as u8).collect()
}

fn start(tag: &str, ring: u64) -> SlicePublisher {
    SlicePublisher::start(&PublisherConfig {
        socket: name(tag),
        ring_bytes: ring,
        max_consumers: 4,
        max_hold: Duration::from_secs(3600),
        any_user: false,
        run: 7,
        builder: 1,
    })
    .unwrap()
}

/// Waits (bounded) until the publisher has taken `n` consumers in.
fn wait_attached(p: &mut SlicePublisher, n: usize) {
    for _ in 0..500 {
        if p.consumers() == n {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("consumers did not attach");
}

#[test]
fn every_slice_arrives_byte_for_byte_with_a_hold_consumer() {
    let mut p = start("hold", 1 << 16);
    let reader = std::thread::spawn(move || {
        let opts = ConsumerOptions { policy: Policy::Hold { max: Duration::from_secs(60) }, window: 2 };
        let mut c = SliceConsumer::connect_within(&name("hold"), opts, Duration::from_secs(10)).unwrap();
        assert_eq!((c.run, c.builder), (7, 1));
        let mut seen = Vec::new();
        loop {
            match c.next(None).unwrap() {
                Next::Slice(s) => {
                    for f in s.fragments() {
                        assert_eq!(f.payload, payload(s.slice, f.source, f.payload.len()), "slice {}", s.slice);
                        assert_eq!(f.hit_count, f.source * 2);
                    }
                    seen.push((s.slice, s.fragment_count()));
                    assert!(s.release(), "a hold consumer within its bound is never overrun");
                }
                Next::End { offered, skipped, overrun } => return (seen, offered, skipped, overrun),
                Next::Timeout => unreachable!("no timeout given"),
            }
        }
    });
    wait_attached(&mut p, 1);
    // 200 slices of 3 fragments, about 9 kB each, through a 64 kB ring: it wraps many times.
    for slice in 0..200u64 {
        let bufs: Vec<Vec<u8>> = (0..3).map(|s| payload(slice, s, 1000 + 1500 * s as usize + slice as usize)).collect();
        let frags: Vec<(u32, u16, u32, &[u8])> =
            bufs.iter().enumerate().map(|(s, b)| (s as u32, 0, s as u32 * 2, b.as_slice())).collect();
        p.publish(slice, slice * 1000, 1000, &frags);
    }
    let report = p.finish();
    let (seen, offered, skipped, overrun) = reader.join().unwrap();
    assert_eq!(seen.len(), 200);
    assert!(seen.iter().enumerate().all(|(i, (s, n))| *s == i as u64 && *n == 3));
    assert_eq!((offered, skipped, overrun), (200, 0, 0));
    assert_eq!(report.published, 200);
    assert_eq!(report.consumers[0].released, 200);
}

#[test]
fn a_skip_consumer_that_never_releases_is_skipped_and_overrun_never_waited_for() {
    let mut p = start("skip", 1 << 14);
    let mut c = SliceConsumer::connect_within(
        &name("skip"),
        ConsumerOptions { policy: Policy::Skip, window: 2 },
        Duration::from_secs(10),
    )
    .unwrap();
    wait_attached(&mut p, 1);
    let buf = vec![5u8; 3000];
    p.publish(0, 0, 1, &[(0, 0, 0, &buf)]);
    p.publish(1, 0, 1, &[(0, 0, 0, &buf)]);
    // Holds the first two slices (its window) and never releases them while publishing.
    let mut held = Vec::new();
    for _ in 0..2 {
        match c.next(Some(Duration::from_secs(10))).unwrap() {
            Next::Slice(s) => held.push(s),
            _ => panic!("expected a slice"),
        }
    }
    assert!(held.iter().all(|s| s.intact()));
    for slice in 2..20u64 {
        p.publish(slice, 0, 1, &[(0, 0, 0, &buf)]);
    }
    let report = p.finish();
    let c0 = report.consumers[0];
    // Every slice was offered or skipped; the ring (16 kB, about 3 kB a slot) took the two
    // held ones back, which opened the window for later ones (never read, taken back too).
    assert_eq!(c0.offered + c0.skipped, 20);
    assert!(c0.skipped > 0 && c0.overrun >= 2, "{c0:?}");
    assert_eq!(c0.released, 0);
    assert!(held.iter().all(|s| !s.intact()));
    assert_eq!(report.held_s, 0.0, "never waited for a skip consumer");
    // What is still queued for it: slices (the ones taken back are passed over), then the end.
    let mut read = 0;
    loop {
        match c.next(Some(Duration::from_secs(10))).unwrap() {
            Next::Slice(s) => {
                read += 1;
                s.release();
            }
            Next::End { offered, skipped, overrun } => {
                assert_eq!((offered, skipped, overrun), (c0.offered, c0.skipped, c0.overrun));
                break;
            }
            Next::Timeout => panic!("the end never came"),
        }
    }
    assert_eq!(read + c.lost_before_read + 2, c0.offered);
}

#[test]
fn a_consumer_that_disconnects_frees_its_slots_and_the_name_is_reusable() {
    let mut p = start("gone", 1 << 13);
    let c = SliceConsumer::connect_within(
        &name("gone"),
        ConsumerOptions { policy: Policy::Hold { max: Duration::from_secs(3600) }, window: 8 },
        Duration::from_secs(10),
    )
    .unwrap();
    wait_attached(&mut p, 1);
    let buf = vec![1u8; 3000];
    p.publish(0, 0, 1, &[(0, 0, 0, &buf)]);
    p.publish(1, 0, 1, &[(0, 0, 0, &buf)]);
    // The ring is full of held slots; the consumer goes away without a word.
    drop(c);
    // With an hour's hold this would wait an hour if the departure were not seen.
    p.publish(2, 0, 1, &[(0, 0, 0, &buf)]);
    let report = p.finish();
    // Seen as gone, not waited for: slice 2 found nobody, or (when a fork elsewhere in this
    // process still held the consumer's socket until its exec) it was written once the
    // ring, needing the space, saw the socket close, and offered to no one.
    assert_eq!(report.published + report.unwatched, 3);
    assert_eq!(report.consumers[0].offered, 2);
    // The abstract name is free again at once.
    let mut p2 = start("gone", 1 << 13);
    assert_eq!(p2.consumers(), 0);
    p2.publish(0, 0, 1, &[(0, 0, 0, &buf)]);
    assert_eq!(p2.finish().unwatched, 1);
}

#[test]
fn garbage_on_the_socket_is_refused_and_counted() {
    let p = start("garbage", 1 << 13);
    use std::os::unix::net::UnixDatagram;
    let _ = UnixDatagram::unbound(); // (a datagram socket cannot connect to a seqpacket one)
    let fd = rustix::net::socket(rustix::net::AddressFamily::UNIX, rustix::net::SocketType::SEQPACKET, None).unwrap();
    rustix::net::connect(&fd, &rustix::net::SocketAddrUnix::new_abstract_name(name("garbage").as_bytes()).unwrap())
        .unwrap();
    rustix::io::write(&fd, b"hello, is this the slice ring?").unwrap();
    // The builder closes the connection: a read sees the end.
    let mut b = [0u8; 64];
    assert_eq!(rustix::io::read(&fd, &mut b).unwrap(), 0);
    assert_eq!(p.finish().refused, 1);
}

#[test]
fn a_consumer_of_another_user_is_refused() {
    use std::os::unix::process::CommandExt;
    if !rustix::process::getuid().is_root() {
        eprintln!("skipped: needs root to run a consumer as another user");
        return;
    }
    let p = start("other-user", 1 << 13);
    // A hello from user `nobody`: the connection is closed without a welcome.
    let script = r#"
import socket, struct, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.connect("\0" + sys.argv[1])
try:
    # Refused at accept: the hello may already meet a closed socket.
    s.send(struct.pack("<II5Q", 1, 1, 1, 0, 4, 0, 0))
    print("closed" if s.recv(64) == b"" else "welcomed")
except (BrokenPipeError, ConnectionResetError):
    print("closed")
"#;
    let out = std::process::Command::new("python3")
        .args(["-c", script, &name("other-user")])
        .uid(65534)
        .gid(65534)
        .output()
        .expect("python3 runs");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "closed", "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(p.finish().refused, 1);
}
