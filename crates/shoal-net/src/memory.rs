//! How a shoal process takes memory from the kernel.
//!
//! The data path allocates and frees fragment-sized buffers (tens of kB) at the data
//! rate, from several threads. With transparent huge pages (mimalloc asks for them with
//! `madvise`, and a system set to `always` gives them anyway), every fresh allocator page
//! was a 2-MiB page the kernel cleared first: on the fixed-fragment workload of
//! `scripts/cost.py` (30 x 10, 30-kB fragments, 10-ms slices) two thirds of all the CPU
//! was `clear_page_erms`, and the fragment cost 124 us of CPU with them, 57 us without
//! (docs/bench/history.md, "Huge pages"). [`disable_huge_pages`] turns them off for the
//! process, before it allocates in earnest.
//!
//! Even in 4-kB pages, a run faults its working set in page by page: a 15-s live
//! full-shape demo (300 x 100) took 1.4-2.5 million page faults, about one per page of its
//! peak resident memory (5-8 GB), each a trap, a cleared page and a charge to the cgroup,
//! while the run had no CPU to spare (docs/bench/history.md, "Memory mapped before the run").
//! [`prefault`] (`[run] prefault_mb`) takes that memory before the run, as a DAQ
//! allocates its buffer pools when it is configured: it
//! tells mimalloc to keep what is freed, touches the memory through the allocator and
//! frees it, so that the run's buffers land in pages already mapped.

/// Turns transparent huge pages off for this process and its children (Linux
/// `PR_SET_THP_DISABLE`, checked at each page fault, so memory mapped before counts too).
/// Returns the kernel's error where it refuses (the process then runs as before).
#[allow(unsafe_code)]
pub fn disable_huge_pages() -> std::io::Result<()> {
    // SAFETY: prctl with PR_SET_THP_DISABLE takes integer arguments only and reads or
    // writes no memory of the process.
    let rc = unsafe {
        libc::prctl(
            libc::PR_SET_THP_DISABLE,
            1 as libc::c_ulong,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
        )
    };
    if rc == 0 { Ok(()) } else { Err(std::io::Error::last_os_error()) }
}

/// mimalloc's `mi_option_purge_delay` (its `mi_option_e` in version 3, which
/// libmimalloc-sys builds; the crate's Rust bindings predate the option). A unit test
/// checks that it reads version 3's default.
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// The pieces [`prefault`] allocates: few enough calls to the kernel, and pages mimalloc
/// hands on to the data path's blocks. Of 30-kB buffers written afterwards (the test
/// `fragment_buffers_land_in_prefaulted_pages`), 1.6 % of the pages faulted after pieces of
/// 256 KiB, 2 % after 64 KiB, 15-17 % after 1-4 MiB and 42 % after 32 MiB.
const PREFAULT_CHUNK: usize = 256 << 10;

/// What [`prefault`] did.
#[derive(Clone, Copy, Debug)]
pub struct Prefaulted {
    pub bytes: u64,
    pub took: std::time::Duration,
}

/// Why [`prefault`] did nothing.
#[derive(Debug, thiserror::Error)]
pub enum PrefaultError {
    #[error("the process's allocator is not mimalloc: memory touched now would not be kept for the run")]
    NotMimalloc,
}

/// Maps `bytes` of memory into the process before its run and leaves it with the
/// allocator (see the module doc): mimalloc is told never to return freed memory to the
/// kernel (the process's resident memory then stays at its peak, within the budget), and
/// `bytes` are allocated, populated by the kernel (`MADV_POPULATE_WRITE`, or a write to
/// each page where the kernel lacks it) and freed.
pub fn prefault(bytes: u64) -> Result<Prefaulted, PrefaultError> {
    let start = std::time::Instant::now();
    let probe = Box::new(0u64);
    // SAFETY: mi_is_in_heap_region only compares the address with mimalloc's arenas.
    #[allow(unsafe_code)]
    let ours = unsafe { libmimalloc_sys::mi_is_in_heap_region(std::ptr::from_ref(&*probe).cast()) };
    if !ours {
        return Err(PrefaultError::NotMimalloc);
    }
    // SAFETY: sets an integer option; mimalloc reads it at each purge it would schedule.
    #[allow(unsafe_code)]
    unsafe {
        libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, -1);
    }
    let chunks = usize::try_from(bytes.div_ceil(PREFAULT_CHUNK as u64)).unwrap_or(usize::MAX);
    let mut held: Vec<Vec<u8>> = Vec::with_capacity(chunks);
    for _ in 0..chunks {
        let mut chunk: Vec<u8> = Vec::with_capacity(PREFAULT_CHUNK);
        populate(chunk.spare_capacity_mut());
        held.push(chunk);
    }
    drop(held);
    Ok(Prefaulted { bytes: chunks as u64 * PREFAULT_CHUNK as u64, took: start.elapsed() })
}

/// `[run] prefault_mb`: [`prefault`], logged (a warning where it cannot be done).
pub fn prefault_configured(mb: u64) -> Option<Prefaulted> {
    if mb == 0 {
        return None;
    }
    match prefault(mb << 20) {
        Ok(p) => {
            tracing::info!("prefaulted {} MiB before the run in {:.2} s", p.bytes >> 20, p.took.as_secs_f64());
            Some(p)
        }
        Err(e) => {
            tracing::warn!("run.prefault_mb = {mb} not done: {e}");
            None
        }
    }
}

/// The minor page faults of this process so far (`getrusage`; 0 where unknown): each a
/// page the kernel mapped on first touch.
pub fn minor_faults() -> u64 {
    minor_faults_of(nix::sys::resource::UsageWho::RUSAGE_SELF)
}

/// The minor page faults of the calling thread so far (0 where unknown).
pub fn minor_faults_of_this_thread() -> u64 {
    minor_faults_of(nix::sys::resource::UsageWho::RUSAGE_THREAD)
}

fn minor_faults_of(who: nix::sys::resource::UsageWho) -> u64 {
    nix::sys::resource::getrusage(who).map_or(0, |u| u64::try_from(u.minor_page_faults()).unwrap_or(0))
}

/// Makes the kernel map every page of `buf` for writing.
fn populate(buf: &mut [std::mem::MaybeUninit<u8>]) {
    const PAGE: usize = 4096;
    let addr = buf.as_mut_ptr() as usize;
    let first = addr.next_multiple_of(PAGE);
    let end = (addr + buf.len()) & !(PAGE - 1);
    if end > first {
        // SAFETY: the range lies inside `buf`, which this function may write; populating
        // changes no byte of it.
        #[allow(unsafe_code)]
        let rc = unsafe { libc::madvise(first as *mut libc::c_void, end - first, libc::MADV_POPULATE_WRITE) };
        if rc == 0 {
            return;
        }
    }
    // An older kernel: a write to each page (the bytes are not initialised for anyone).
    for i in (0..buf.len()).step_by(PAGE) {
        buf[i].write(0);
    }
}

#[cfg(test)]
mod tests {
    /// The option's index is mimalloc version 3's (whose default delay is 1000 ms): a
    /// libmimalloc-sys that builds another version fails here instead of setting another
    /// option. These tests run on the system allocator, so nothing here sets it (nor may
    /// `MIMALLOC_PURGE_DELAY` in the environment).
    #[test]
    #[allow(unsafe_code)]
    fn the_purge_delay_option_is_mimalloc_3s() {
        // SAFETY: reads an integer option.
        assert_eq!(unsafe { libmimalloc_sys::mi_option_get(super::MI_OPTION_PURGE_DELAY) }, 1000);
        assert!(matches!(super::prefault(1 << 20), Err(super::PrefaultError::NotMimalloc)));
        // SAFETY: as above.
        assert_eq!(unsafe { libmimalloc_sys::mi_option_get(super::MI_OPTION_PURGE_DELAY) }, 1000);
    }

    #[test]
    fn minor_faults_count_pages_touched_first() {
        // The process has mapped its own memory by now (a thread may reuse a cached stack).
        assert!(super::minor_faults() > 0);
        // A fresh mapping written page by page: a fault each, on this thread (16,384 in
        // 4-kB pages; 32 where the system hands this test 2-MiB pages).
        let before = super::minor_faults_of_this_thread();
        let mut buf: Vec<u8> = Vec::with_capacity(64 << 20);
        for i in (0..buf.capacity()).step_by(4096) {
            buf.spare_capacity_mut()[i].write(1);
        }
        assert!(super::minor_faults_of_this_thread() - before >= 32);
    }

    #[test]
    fn the_kernel_takes_the_setting() {
        // Run in a child of the test process would be purer; the flag only changes how
        // later page faults are served, which no other test depends on.
        super::disable_huge_pages().unwrap();
        #[allow(unsafe_code)]
        // SAFETY: PR_GET_THP_DISABLE takes no pointer and returns the flag.
        let flag = unsafe {
            libc::prctl(
                libc::PR_GET_THP_DISABLE,
                0 as libc::c_ulong,
                0 as libc::c_ulong,
                0 as libc::c_ulong,
                0 as libc::c_ulong,
            )
        };
        assert_eq!(flag, 1);
    }
}
