//! A network path loses or stalls packets: a process's outgoing data links sent TCP
//! segments again (the kernel's `TCP_INFO`), are stuck in retransmission timeouts now,
//! sent datagrams again on the builders' NACKs, or lost their connections while every
//! builder and the writer were up (a connection lost, or segments sent again, because a
//! peer died, hung or restarted is that peer's doing, named by `process_down` or
//! `process_hung`). Named on the sending process: its links cross the path.

use super::super::{Evaluation, Finding, Rule};

/// Share of the segments (or datagrams) sent again from which a path is losing: a healthy
/// switch and loopback lose none (the processes count a busy host's spurious tail-loss
/// probes out: the peer reports them as duplicates).
pub const RETRANSMIT_SHARE: f64 = 0.002;

/// And at least this many since the last look (a probe whose duplicate report had not
/// come back yet when the counters were read is one or two).
pub const MIN_RETRANSMITTED: u64 = 3;

/// How long after a builder or the writer was gone, silent or restarted the connections
/// lost are put down to it, not to the path.
pub const PEER_AWAY_WINDOW_NS: u64 = 10_000_000_000;

fn losing(again: u64, sent: u64) -> bool {
    again >= MIN_RETRANSMITTED && again as f64 >= RETRANSMIT_SHARE * sent as f64
}

pub fn check(ev: &Evaluation, out: &mut Vec<Finding>) {
    if !ev.snapshot.running {
        return;
    }
    let peer_away = ["builder", "writer"].iter().any(|r| ev.role_away_within(r, PEER_AWAY_WINDOW_NS));
    for p in ev.snapshot.processes.iter().filter(|p| p.role == "source" || p.role == "builder") {
        let g = ev.growth_of(&p.name);
        let mut seen = Vec::new();
        // Segments sent again just after a builder or the writer was gone, silent or
        // restarted are its doing too: a builder that resumes from a hang drains seconds
        // of backlog at once, and its host drops some of the catch-up burst (seen: 3 of
        // 240 from a source, 0.4 s after its builder came back from SIGSTOP).
        if !peer_away && losing(g.tcp_retransmitted, g.tcp_segments_out) {
            seen.push(format!(
                "sent {} of {} TCP segments again ({:.2} %)",
                g.tcp_retransmitted,
                g.tcp_segments_out,
                100.0 * g.tcp_retransmitted as f64 / g.tcp_segments_out.max(1) as f64
            ));
        }
        if p.counters.tcp_links_stalled > 0 {
            seen.push(format!("{} links in retransmission timeouts", p.counters.tcp_links_stalled));
        }
        if losing(g.udp_retransmitted, g.udp_datagrams) {
            seen.push(format!("sent {} datagrams again on NACKs ({} sent)", g.udp_retransmitted, g.udp_datagrams));
        }
        if g.link_failures > 0 && !peer_away {
            seen.push(format!("lost {} connections while writing, their peers up", g.link_failures));
        }
        if !seen.is_empty() {
            out.push(super::finding(Rule::NetworkPath, p, seen.join("; ")));
        }
    }
}
