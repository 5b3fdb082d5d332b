//! The responses kept for `GET /v1/responses/{id}` and for later requests'
//! `previous_response_id`: a bounded in-memory map.
//!
//! Invariants: it never holds more than its capacity (inserting past it
//! drops the oldest response), ids are unique (inserting an id again
//! replaces the old entry, which leaves the eviction order), and entries
//! are shared immutably (`Arc`), so a reader never holds the lock while it
//! renders a prompt. Nothing survives a restart.

use arbor_models::ChatMessage;
use serde_json::Value;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

/// How many responses the server keeps by default.
pub(crate) const CAPACITY: usize = 1000;

/// One stored response.
#[derive(Debug)]
pub(crate) struct Stored {
    /// The response object as it was answered.
    pub response: Value,
    /// The conversation it ends, as chat messages without its instructions:
    /// the previous response's conversation, its input, then its output.
    pub history: Vec<ChatMessage>,
    /// Its request's input items, as `input_items` lists them.
    pub input_items: Vec<Value>,
    /// Its engine request's id (a background response's cancel aborts it).
    pub rid: String,
}

#[derive(Default)]
struct Inner {
    map: HashMap<String, Arc<Stored>>,
    /// Ids, oldest first.
    order: VecDeque<String>,
}

/// The bounded store.
pub(crate) struct Store {
    capacity: usize,
    inner: Mutex<Inner>,
}

impl Store {
    /// An empty store keeping at most `capacity` responses (at least one).
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            inner: Mutex::new(Inner::default()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Keeps `stored` under `id`, dropping the oldest response when full.
    pub fn insert(&self, id: &str, stored: Stored) {
        let mut g = self.lock();
        if g.map.remove(id).is_some() {
            g.order.retain(|k| k != id);
        }
        while g.map.len() >= self.capacity {
            let Some(old) = g.order.pop_front() else {
                break;
            };
            g.map.remove(&old);
        }
        g.map.insert(id.to_string(), Arc::new(stored));
        g.order.push_back(id.to_string());
    }

    /// The response stored under `id`.
    pub fn get(&self, id: &str) -> Option<Arc<Stored>> {
        self.lock().map.get(id).cloned()
    }

    /// Removes the response stored under `id`; false when there was none.
    pub fn remove(&self, id: &str) -> bool {
        let mut g = self.lock();
        let found = g.map.remove(id).is_some();
        if found {
            g.order.retain(|k| k != id);
        }
        found
    }

    /// How many responses are stored.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.lock().map.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn stored(n: usize) -> Stored {
        Stored {
            response: json!({"n": n}),
            history: Vec::new(),
            input_items: Vec::new(),
            rid: String::new(),
        }
    }

    #[test]
    fn the_store_keeps_the_newest_responses() {
        let s = Store::new(3);
        for i in 0..5 {
            s.insert(&format!("resp_{i}"), stored(i));
        }
        assert_eq!(s.len(), 3);
        assert!(s.get("resp_0").is_none() && s.get("resp_1").is_none());
        assert_eq!(s.get("resp_4").unwrap().response["n"], 4);
        // Removing frees a place: nothing else is evicted by the next insert.
        assert!(s.remove("resp_3"));
        assert!(!s.remove("resp_3"));
        s.insert("resp_5", stored(5));
        assert_eq!(s.len(), 3);
        assert!(s.get("resp_2").is_some());
        // Replacing an id keeps one entry and renews its age.
        s.insert("resp_2", stored(22));
        s.insert("resp_6", stored(6));
        assert_eq!(s.len(), 3);
        assert!(s.get("resp_4").is_none());
        assert_eq!(s.get("resp_2").unwrap().response["n"], 22);
        assert_eq!(Store::new(0).capacity, 1);
    }
}
