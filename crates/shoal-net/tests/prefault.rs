//! `run.prefault_mb` on the allocator of the `shoal` binary: the pages it maps are the
//! ones the data path's buffers land in afterwards. A test binary of its own, so that no
//! other test's allocations take them first.
use shoal_net::memory::{disable_huge_pages, minor_faults_of_this_thread, prefault};

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[test]
fn fragment_buffers_land_in_prefaulted_pages() {
    const TOTAL: usize = 64 << 20;
    const FRAGMENT: usize = 30_000;
    // 4-kB pages, as the `shoal` binary maps them.
    disable_huge_pages().expect("PR_SET_THP_DISABLE");
    let pages = (TOTAL / 4096) as u64;
    // Without a prefault, fragment-sized buffers written in full fault in about a page per 4 kB.
    let before = minor_faults_of_this_thread();
    let held: Vec<Vec<u8>> = (0..TOTAL / FRAGMENT).map(|_| vec![1u8; FRAGMENT]).collect();
    let cold = minor_faults_of_this_thread() - before;
    drop(held);
    assert!(cold > pages / 2, "{cold} faults for {pages} pages without a prefault");

    let done = prefault(4 * TOTAL as u64).expect("the allocator is mimalloc");
    assert_eq!(done.bytes, 4 * TOTAL as u64);
    // Three quarters of it (a 30-kB buffer takes a 32-kB block).
    let before = minor_faults_of_this_thread();
    let held: Vec<Vec<u8>> = (0..3 * TOTAL / FRAGMENT).map(|_| vec![1u8; FRAGMENT]).collect();
    let warm = minor_faults_of_this_thread() - before;
    drop(held);
    eprintln!("{cold} faults for {pages} pages without a prefault, {warm} for {} after", 3 * pages);
    assert!(warm * 20 < 3 * pages, "{warm} faults for {} pages after a prefault", 3 * pages);
}
