//! A map with a hard cap on its length that knows its oldest entry (I10).
//!
//! The client path keeps three in-process tables (negative cache, fallback buckets, cardinality
//! windows); each must stay bounded under a flood of distinct keys, and each has its own rule for
//! what to do when full (evict the oldest, evict only an idle one, or refuse). This map gives them
//! the common part: a length cap that `insert` never exceeds, and "oldest" by the order in which
//! entries were last inserted (or replaced), in O(log n).

use std::collections::{BTreeMap, HashMap};
use std::hash::Hash;

/// A map of at most `max_len` entries, ordered by last insertion. See the module docs.
#[derive(Debug)]
pub(crate) struct BoundedMap<K, V> {
    entries: HashMap<K, (V, u64)>,
    /// Stamp -> key; the first entry is the oldest.
    order: BTreeMap<u64, K>,
    next_stamp: u64,
    max_len: usize,
}

impl<K: Hash + Eq + Clone, V> BoundedMap<K, V> {
    /// An empty map holding at most `max_len` entries (at least 1).
    pub(crate) fn new(max_len: usize) -> Self {
        Self {
            entries: HashMap::new(),
            order: BTreeMap::new(),
            next_stamp: 0,
            max_len: max_len.max(1),
        }
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    pub(crate) fn is_full(&self) -> bool {
        self.entries.len() >= self.max_len
    }

    pub(crate) fn get(&self, key: &K) -> Option<&V> {
        self.entries.get(key).map(|(value, _)| value)
    }

    pub(crate) fn get_mut(&mut self, key: &K) -> Option<&mut V> {
        self.entries.get_mut(key).map(|(value, _)| value)
    }

    /// Inserts or replaces `key` as the newest entry. A new key in a full map is handed back
    /// (`Err`): the caller decides what to evict, if anything.
    pub(crate) fn insert(&mut self, key: K, value: V) -> Result<(), (K, V)> {
        if !self.entries.contains_key(&key) && self.is_full() {
            return Err((key, value));
        }
        let stamp = self.stamp();
        if let Some((_, previous)) = self.entries.insert(key.clone(), (value, stamp)) {
            self.order.remove(&previous);
        }
        self.order.insert(stamp, key);
        debug_assert_eq!(self.entries.len(), self.order.len());
        debug_assert!(self.entries.len() <= self.max_len);
        Ok(())
    }

    pub(crate) fn remove(&mut self, key: &K) -> Option<V> {
        let (value, stamp) = self.entries.remove(key)?;
        self.order.remove(&stamp);
        Some(value)
    }

    /// The entry stamped longest ago.
    pub(crate) fn oldest(&self) -> Option<(&K, &V)> {
        let (_, key) = self.order.first_key_value()?;
        self.entries.get(key).map(|(value, _)| (key, value))
    }

    /// Removes the entry stamped longest ago.
    pub(crate) fn pop_oldest(&mut self) -> Option<(K, V)> {
        let (_, key) = self.order.pop_first()?;
        let (value, _) = self.entries.remove(&key)?;
        Some((key, value))
    }

    fn stamp(&mut self) -> u64 {
        self.next_stamp += 1;
        self.next_stamp
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn never_exceeds_its_cap_and_orders_by_last_stamp() {
        let mut map = BoundedMap::new(2);
        map.insert("a", 1).expect("room");
        map.insert("b", 2).expect("room");
        assert_eq!(map.insert("c", 3), Err(("c", 3)), "full: handed back");
        map.insert("a", 10).expect("replacing needs no room");
        assert_eq!(map.oldest(), Some((&"b", &2)), "replacing a restamps it");
        map.insert("b", 20).expect("replacing");
        assert_eq!(map.oldest(), Some((&"a", &10)));
        assert_eq!(map.pop_oldest(), Some(("a", 10)));
        map.insert("c", 3).expect("room after the pop");
        assert_eq!(map.len(), 2);
        assert_eq!(map.remove(&"b"), Some(20));
        assert_eq!(map.oldest(), Some((&"c", &3)));
        assert_eq!(map.get(&"b"), None);
    }
}
