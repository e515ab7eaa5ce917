//! [`SliceMap`]: values keyed by slice number in a sliding window.
//!
//! A source holds its pending frames for a few slices: inserted in slice order, removed
//! mostly in order. A ring of slots indexed by `slice - base` makes insert, lookup and
//! removal O(1) without hashing, which matters in the simulator, where every fragment of
//! every board passes through it.

use std::collections::VecDeque;

use crate::slice::SliceNumber;

#[derive(Clone, Debug)]
pub(crate) struct SliceMap<T> {
    /// The slice of `slots[0]`.
    base: SliceNumber,
    slots: VecDeque<Option<T>>,
    len: usize,
}

impl<T> Default for SliceMap<T> {
    fn default() -> Self {
        Self { base: 0, slots: VecDeque::new(), len: 0 }
    }
}

impl<T> SliceMap<T> {
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Inserts `value` at `slice`, returning the value it replaces.
    pub(crate) fn insert(&mut self, slice: SliceNumber, value: T) -> Option<T> {
        if self.slots.is_empty() {
            self.base = slice;
        }
        if slice < self.base {
            for _ in slice..self.base {
                self.slots.push_front(None);
            }
            self.base = slice;
        }
        let i = (slice - self.base) as usize;
        if i >= self.slots.len() {
            self.slots.resize_with(i + 1, || None);
        }
        let old = self.slots[i].replace(value);
        if old.is_none() {
            self.len += 1;
        }
        old
    }

    fn index(&self, slice: SliceNumber) -> Option<usize> {
        let i = usize::try_from(slice.checked_sub(self.base)?).ok()?;
        (i < self.slots.len()).then_some(i)
    }

    pub(crate) fn contains(&self, slice: SliceNumber) -> bool {
        self.index(slice).is_some_and(|i| self.slots[i].is_some())
    }

    pub(crate) fn get_mut(&mut self, slice: SliceNumber) -> Option<&mut T> {
        let i = self.index(slice)?;
        self.slots[i].as_mut()
    }

    pub(crate) fn remove(&mut self, slice: SliceNumber) -> Option<T> {
        let i = self.index(slice)?;
        let v = self.slots[i].take()?;
        self.len -= 1;
        while let Some(None) = self.slots.front() {
            self.slots.pop_front();
            self.base += 1;
        }
        while let Some(None) = self.slots.back() {
            self.slots.pop_back();
        }
        Some(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    proptest! {
        /// Behaves like a map, whatever the order of operations.
        #[test]
        fn behaves_like_a_btreemap(ops in prop::collection::vec((0u8..3, 0u64..40), 0..300)) {
            let mut m = SliceMap::default();
            let mut r = BTreeMap::new();
            for (op, slice) in ops {
                match op {
                    0 => prop_assert_eq!(m.insert(slice, slice * 10), r.insert(slice, slice * 10)),
                    1 => prop_assert_eq!(m.remove(slice), r.remove(&slice)),
                    _ => prop_assert_eq!(m.get_mut(slice).copied(), r.get(&slice).copied()),
                }
                prop_assert_eq!(m.len(), r.len());
            }
        }
    }
}
