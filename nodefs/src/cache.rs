//! A bounded first-in-first-out cache of immutable objects by id. Objects are addressed by
//! their hash, so an entry is never stale; the bound only caps memory.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use crate::id::ObjectId;

pub(crate) struct Cache<V> {
    map: HashMap<ObjectId, (Arc<V>, usize)>,
    order: VecDeque<ObjectId>,
    weight: usize,
    cap: usize,
}

impl<V> Cache<V> {
    /// Holds entries up to a total weight of `cap` (each entry's weight is given at `put`).
    pub fn new(cap: usize) -> Self {
        Cache {
            map: HashMap::new(),
            order: VecDeque::new(),
            weight: 0,
            cap,
        }
    }

    pub fn get(&self, id: &ObjectId) -> Option<Arc<V>> {
        self.map.get(id).map(|(v, _)| v.clone())
    }

    /// Adds `v`, evicting the oldest entries while the total weight is over the cap.
    pub fn put(&mut self, id: ObjectId, v: Arc<V>, weight: usize) {
        if self.map.contains_key(&id) {
            return;
        }
        self.weight += weight;
        self.map.insert(id, (v, weight));
        self.order.push_back(id);
        while self.weight > self.cap {
            let Some(old) = self.order.pop_front() else {
                break;
            };
            if let Some((_, w)) = self.map.remove(&old) {
                self.weight -= w;
            }
        }
    }

    pub fn remove(&mut self, id: &ObjectId) {
        if let Some((_, w)) = self.map.remove(id) {
            self.weight -= w;
        }
    }

    /// Drops the entries `keep` says no to (their ids stay in the eviction order until
    /// they come up, where they are skipped).
    pub fn retain(&mut self, keep: impl Fn(&ObjectId) -> bool) {
        let mut freed = 0;
        self.map.retain(|k, (_, w)| {
            let k = keep(k);
            if !k {
                freed += *w;
            }
            k
        });
        self.weight -= freed;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(n: u8) -> ObjectId {
        ObjectId::hash(&[n])
    }

    #[test]
    fn evicts_oldest_first_by_weight() {
        let mut c = Cache::new(10);
        c.put(id(1), Arc::new(1), 4);
        c.put(id(2), Arc::new(2), 4);
        c.put(id(3), Arc::new(3), 4);
        assert!(c.get(&id(1)).is_none(), "over the cap, the oldest goes");
        assert_eq!(c.get(&id(2)).as_deref(), Some(&2));
        assert_eq!(c.get(&id(3)).as_deref(), Some(&3));
        c.remove(&id(2));
        c.retain(|k| *k != id(3));
        assert!(c.get(&id(2)).is_none() && c.get(&id(3)).is_none());
        assert_eq!(c.weight, 0);
        c.put(id(4), Arc::new(4), 10);
        assert_eq!(
            c.get(&id(4)).as_deref(),
            Some(&4),
            "stale order entries evict nothing live"
        );
    }
}
