//! The receive region: one block of memory, registered with UCX once (`ucp_mem_map`),
//! that rendezvous payloads land in, carved into [`Slot`]s.
//!
//! A builder keeps a fragment until its slice is built, so slots are freed roughly in the
//! order they were taken but not exactly. The allocator is first-fit over the free extents
//! in address order, neighbours merged on free: what is in use stays packed at the
//! region's low end, in pages already touched. (Next-fit, a ring buffer's rover, walked the
//! whole region through fresh pages before it came back to warm ones: a builder's region
//! is its memory budget, gigabytes, and a first touch costs a page fault and zeroing, which
//! at 1 MB fragments cut goodput to a fifth of the heap's.) A slot handed on as [`Bytes`] returns to the region when the
//! last reference to it is dropped, on whatever thread that is; a worker waiting for room
//! is woken then ([`Region::room`]).
//!
//! The memory is this crate's (an anonymous mapping), not UCX's: UCX's registration ends
//! with the worker, the memory with the last slot, so a fragment may outlive its worker.

#![allow(unsafe_code)]

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use tokio::sync::Notify;

/// Slots start on cache lines: two payloads never share one.
const ALIGN: usize = 64;

/// The free extents (offset → length).
#[derive(Debug)]
struct Extents {
    free: BTreeMap<usize, usize>,
    in_use: usize,
    /// A worker found no room and waits for some.
    waiting: bool,
}

/// Memory for receive buffers.
pub struct Region {
    /// Never moved or resized while the region lives; reached only through `base`.
    map: memmap2::MmapMut,
    /// The mapping's start, taken once from it as a mutable pointer: slots write through
    /// it (never through a shared reference to the mapping).
    base: *mut u8,
    extents: Mutex<Extents>,
    room: Notify,
    /// Most bytes in use at once.
    pub peak_in_use: AtomicU64,
}

// SAFETY: the mapping is reached only through slots, each a disjoint extent handed out
// under the lock; the pointer is the mapping's, which lives as long as the region.
unsafe impl Send for Region {}
// SAFETY: as above.
unsafe impl Sync for Region {}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Region").field("len", &self.len()).finish_non_exhaustive()
    }
}

impl Region {
    /// A region of `len` bytes (rounded up to the alignment), mapped but not yet touched.
    pub fn new(len: usize) -> std::io::Result<Arc<Region>> {
        let len = len.max(ALIGN).next_multiple_of(ALIGN);
        let mut map = memmap2::MmapMut::map_anon(len)?;
        let base = map.as_mut_ptr();
        let mut free = BTreeMap::new();
        free.insert(0, len);
        Ok(Arc::new(Region {
            map,
            base,
            extents: Mutex::new(Extents { free, in_use: 0, waiting: false }),
            room: Notify::new(),
            peak_in_use: AtomicU64::new(0),
        }))
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// The base address, for UCX's registration.
    pub fn base(&self) -> *mut u8 {
        self.base
    }

    /// Bytes in slots now.
    pub fn in_use(&self) -> usize {
        self.extents.lock().expect("region").in_use
    }

    /// A slot of `len` bytes, or `None` while there is no room (then, if `wait`, the
    /// next slot returned wakes [`Region::room`]).
    pub fn take(self: &Arc<Self>, len: usize, wait: bool) -> Option<Slot> {
        let want = len.max(1).next_multiple_of(ALIGN);
        let mut e = self.extents.lock().expect("region");
        let found = e.free.iter().find(|&(_, &l)| l >= want).map(|(&o, &l)| (o, l));
        let Some((offset, free_len)) = found else {
            e.waiting |= wait;
            return None;
        };
        e.free.remove(&offset);
        if free_len > want {
            e.free.insert(offset + want, free_len - want);
        }
        e.in_use += want;
        self.peak_in_use.fetch_max(e.in_use as u64, Ordering::Relaxed);
        Some(Slot { region: self.clone(), offset, len, reserved: want })
    }

    /// Resolves once a slot has come back after a [`Region::take`] that waited.
    pub async fn room(&self) {
        self.room.notified().await
    }

    fn give_back(&self, offset: usize, reserved: usize) {
        let mut e = self.extents.lock().expect("region");
        e.in_use -= reserved;
        let (mut start, mut len) = (offset, reserved);
        if let Some((&o, &l)) = e.free.range(..offset).next_back()
            && o + l == offset
        {
            e.free.remove(&o);
            start = o;
            len += l;
        }
        if let Some(l) = e.free.remove(&(offset + reserved)) {
            len += l;
        }
        e.free.insert(start, len);
        if std::mem::take(&mut e.waiting) {
            drop(e);
            self.room.notify_one();
        }
    }
}

/// One receive buffer in a [`Region`]: written by UCX, then read-only as [`Bytes`].
pub struct Slot {
    region: Arc<Region>,
    offset: usize,
    len: usize,
    reserved: usize,
}

impl std::fmt::Debug for Slot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Slot").field("offset", &self.offset).field("len", &self.len).finish()
    }
}

impl Slot {
    /// Where UCX writes the payload.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        // SAFETY: within the mapping (offset + len <= its length, checked at take).
        unsafe { self.region.base().add(self.offset) }
    }

    /// The slot's first `len` bytes (what arrived) as shared, read-only bytes; the slot
    /// returns to its region when the last of them is dropped.
    pub fn into_bytes(mut self, len: usize) -> Bytes {
        self.len = self.len.min(len);
        Bytes::from_owner(self)
    }

    /// Copies `data` into the slot and hands it on (an eager payload).
    pub fn fill(mut self, data: &[u8]) -> Bytes {
        let n = data.len().min(self.len);
        // SAFETY: the slot's extent is its own; `n` is within it.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.as_mut_ptr(), n) };
        self.into_bytes(n)
    }
}

impl AsRef<[u8]> for Slot {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: the extent is this slot's alone; UCX has finished writing it before the
        // slot is read (into_bytes is called from the completion).
        unsafe { std::slice::from_raw_parts(self.region.base().add(self.offset), self.len) }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.region.give_back(self.offset, self.reserved);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_full_region_waits_and_is_woken_when_a_slot_returns() {
        let r = Region::new(4 * ALIGN).unwrap();
        let a = r.take(2 * ALIGN, false).unwrap();
        let b = r.take(2 * ALIGN, false).unwrap();
        assert!(r.take(1, true).is_none());
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let bytes = b.fill(b"payload");
        drop(a);
        // The permit is stored: the waiter finds it even though it comes after.
        rt.block_on(r.room());
        assert_eq!(&bytes[..], b"payload");
        assert_eq!(r.in_use(), 2 * ALIGN);
        drop(bytes);
        assert_eq!(r.in_use(), 0);
        assert!(r.take(4 * ALIGN, false).is_some(), "freed neighbours merge into one extent");
    }

    proptest! {
        /// Slots never overlap, every byte comes back, and once all are freed the
        /// region is one extent again.
        #[test]
        fn slots_are_disjoint_and_all_come_back(ops in proptest::collection::vec((1usize..5000, any::<bool>()), 1..200)) {
            let r = Region::new(64 << 10).unwrap();
            let mut held: Vec<Slot> = Vec::new();
            for (len, free_one) in ops {
                if free_one && !held.is_empty() {
                    let i = len % held.len();
                    held.swap_remove(i);
                }
                if let Some(s) = r.take(len, false) {
                    held.push(s);
                }
                let mut spans: Vec<(usize, usize)> = held.iter().map(|s| (s.offset, s.offset + s.reserved)).collect();
                spans.sort();
                prop_assert!(spans.windows(2).all(|w| w[0].1 <= w[1].0), "overlap: {spans:?}");
                prop_assert!(spans.last().is_none_or(|s| s.1 <= r.len()));
                prop_assert_eq!(r.in_use(), held.iter().map(|s| s.reserved).sum::<usize>());
            }
            held.clear();
            prop_assert_eq!(r.in_use(), 0);
            let e = r.extents.lock().unwrap();
            prop_assert_eq!(e.free.len(), 1);
            prop_assert_eq!(e.free.get(&0), Some(&r.len()));
        }
    }
}
