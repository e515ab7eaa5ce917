//! How a shoal process takes memory from the kernel.
//!
//! The data path allocates and frees fragment-sized buffers (tens of kB) at the data
//! rate, from several threads. With transparent huge pages (mimalloc asks for them with
//! `madvise`, and a system set to `always` gives them anyway), every fresh allocator page
//! was a 2-MiB page the kernel cleared first: on the fixed-fragment workload of
//! `scripts/cost.py` (30 x 10, 30-kB fragments, 10-ms slices) two thirds of all the CPU
//! was `clear_page_erms`, and the fragment cost 124 us of CPU with them, 57 us without
//! (docs/benchmarks.md, "Huge pages"). [`disable_huge_pages`] turns them off for the
//! process, before it allocates in earnest.

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

#[cfg(test)]
mod tests {
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
