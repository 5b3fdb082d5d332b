//! KV tiers below the device pool (HiCache): page keys, the host page pool,
//! the storage trait and the page copies a step performs.
//!
//! - [`PageKey`]: SGLang's chained page hash. The key of page `i` of a
//!   sequence is `sha256(key[i-1] ‖ tokens of page i as u32 LE)`, and the
//!   chain starts from [`TierIdentity::root_key`] (model, KV dtype, page
//!   size, KV layout and cache namespace), so two models, dtypes, page sizes
//!   or adapters never share an entry.
//! - [`HostKvPool`]: host memory for KV pages in the device layout (per layer
//!   the page's K bytes then its V bytes), from a [`HostMemory`] when the
//!   device gives one (pinned memory on GPUs, which copies reach at full
//!   speed), else the heap. [`HostPages`] owns slots and frees
//!   them on drop, like [`PageSet`](crate::kv::PageSet) does for device pages.
//!   Each allocation of a slot bumps its generation; a reader holding an old
//!   generation sees the slot as gone, so a slot freed and reused is never
//!   read as the old page. [`HeldSlots`] keep pages unchanged while a device
//!   copies from them in place: a write to a held slot waits, even after the
//!   slot was freed and allocated again.
//! - [`KvTier`]: a storage tier (file directory, redis, ...) with batch
//!   `exists`/`get`/`set` by key; it never panics on I/O, it returns
//!   [`TierError`].
//! - [`KvTierOps`]: the copies between device pages and host slots that a
//!   step performs, in order, before its forward (on asynchronous devices
//!   the loads run beside it, layer by layer: `Backend::write_async`).

pub use crate::backend::host_memory::{HostMemory, HostRegion};
use crate::dtype::DType;
use crate::kv::KvSpec;
use crate::kv::namespace::CacheNamespace;
use std::fmt;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Bytes of a page key.
pub const PAGE_KEY_BYTES: usize = 32;

/// Chained hash of a page's tokens and everything before them (see the module doc).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PageKey(pub [u8; PAGE_KEY_BYTES]);

impl PageKey {
    /// Lowercase hex, as SGLang's storage keys.
    pub fn hex(&self) -> String {
        let mut s = String::with_capacity(2 * PAGE_KEY_BYTES);
        for b in self.0 {
            s.push_str(&format!("{b:02x}"));
        }
        s
    }

    /// Parses [`hex`](Self::hex) output.
    pub fn from_hex(s: &str) -> Option<Self> {
        if s.len() != 2 * PAGE_KEY_BYTES || !s.is_ascii() {
            return None;
        }
        let mut out = [0u8; PAGE_KEY_BYTES];
        for (i, b) in out.iter_mut().enumerate() {
            *b = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
        }
        Some(Self(out))
    }

    /// The key of the page of `tokens` that follows the page keyed `self`.
    pub fn next(&self, tokens: &[u32]) -> PageKey {
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        h.update(self.0);
        for t in tokens {
            h.update(t.to_le_bytes());
        }
        PageKey(h.finalize().into())
    }
}

impl fmt::Debug for PageKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PageKey({})", &self.hex()[..16])
    }
}

/// Chained keys of the whole pages of `tokens`, starting after `prev`.
pub fn page_keys(prev: PageKey, tokens: &[u32], page_size: usize) -> Vec<PageKey> {
    let mut keys = Vec::with_capacity(tokens.len() / page_size.max(1));
    let mut k = prev;
    for page in tokens.chunks_exact(page_size.max(1)) {
        k = k.next(page);
        keys.push(k);
    }
    keys
}

/// What a stored page was computed by: entries of different identities never mix.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TierIdentity {
    /// The model's identity (its name and a digest of its configuration).
    pub model: String,
    /// Element type of the stored KV.
    pub kv_dtype: DType,
    /// Tokens per page.
    pub page_size: usize,
    /// Layers, KV heads and head dimension of a page.
    pub num_layers: usize,
    /// KV heads per layer.
    pub num_kv_heads: usize,
    /// Dimension of one head.
    pub head_dim: usize,
    /// A page holds K only: the values are the keys ([`KvSpec::values_in_keys`]).
    pub values_in_keys: bool,
}

impl TierIdentity {
    /// The identity of KV of `spec` computed by `model`.
    pub fn new(model: impl Into<String>, spec: &KvSpec) -> Self {
        Self {
            model: model.into(),
            kv_dtype: spec.dtype,
            page_size: spec.page_size,
            num_layers: spec.num_layers,
            num_kv_heads: spec.num_kv_heads,
            head_dim: spec.head_dim,
            values_in_keys: spec.values_in_keys,
        }
    }

    /// Digest of the identity (stored in every entry's header).
    pub fn digest(&self) -> [u8; PAGE_KEY_BYTES] {
        use sha2::{Digest, Sha256};
        let mut text = format!(
            "arbor-kv-v1\u{1f}{}\u{1f}{}\u{1f}{}\u{1f}{}x{}x{}",
            self.model,
            self.kv_dtype,
            self.page_size,
            self.num_layers,
            self.num_kv_heads,
            self.head_dim
        );
        // Pages of K alone (a latent cache) never match pages of K and V;
        // the digest of K-and-V pages is what it was before the flag.
        if self.values_in_keys {
            text.push_str("\u{1f}values-in-keys");
        }
        Sha256::digest(text.as_bytes()).into()
    }

    /// The key the chain of a sequence in namespace `ns` starts from.
    pub fn root_key(&self, ns: &CacheNamespace) -> PageKey {
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        h.update(self.digest());
        match &ns.0 {
            None => h.update([0u8]),
            Some(s) => {
                h.update([1u8]);
                h.update(s.as_bytes());
            }
        }
        PageKey(h.finalize().into())
    }

    /// Bytes of one page in the host layout.
    pub fn page_bytes(&self) -> usize {
        let tensors = if self.values_in_keys { 1 } else { 2 };
        tensors
            * self.num_layers
            * self.page_size
            * self.num_kv_heads
            * self.head_dim
            * self.kv_dtype.block_bytes()
            / self.kv_dtype.block_size()
    }
}

/// Why a storage tier operation failed. The caller recomputes; nothing is lost.
#[derive(Debug, thiserror::Error)]
pub enum TierError {
    /// The store cannot be reached (connection refused, server gone).
    #[error("storage unavailable: {0}")]
    Unavailable(String),
    /// An I/O operation failed.
    #[error("storage I/O failed: {0}")]
    Io(String),
    /// The store's configuration is invalid.
    #[error("storage configuration: {0}")]
    Config(String),
}

/// A storage tier: pages by key, in batches.
///
/// Entries are whole pages of [`TierIdentity::page_bytes`] bytes. A store
/// checks what it reads (length and checksum): an entry that fails is
/// reported missing and removed, never returned.
pub trait KvTier: Send + Sync {
    /// Registered name (`file`, `redis`).
    fn name(&self) -> &str;
    /// Which keys the store holds.
    fn exists(&self, keys: &[PageKey]) -> Result<Vec<bool>, TierError>;
    /// The pages stored under `keys` (`None`: missing or failed its check).
    fn get(&self, keys: &[PageKey]) -> Result<Vec<Option<Vec<u8>>>, TierError>;
    /// Stores pages; each entry is written whole or not at all.
    fn set(&self, entries: &[(PageKey, &[u8])]) -> Result<(), TierError>;
    /// Removes every entry of this store's identity.
    fn clear(&self) -> Result<(), TierError>;
    /// Entries found damaged and removed so far.
    fn corrupt_removed(&self) -> u64 {
        0
    }
}

struct Slot {
    /// Generation of the current allocation (0: never allocated).
    generation: u64,
    /// Generation whose page the bytes hold (0: none).
    filled: u64,
    /// The page's memory, taken when the slot is first written.
    bytes: Option<Box<dyn HostRegion>>,
    /// [`HeldSlots`] holding the bytes unchanged (writes wait for none).
    held: u32,
}

impl Slot {
    fn page(&self) -> &[u8] {
        self.bytes.as_ref().map_or(&[], |b| b.bytes())
    }
}

/// Host memory for KV pages (see the module doc).
pub struct HostKvPool {
    page_bytes: usize,
    slots: Vec<Mutex<Slot>>,
    filled: Condvar,
    free: Mutex<Vec<u32>>,
    memory: Option<Arc<dyn HostMemory>>,
    /// Slots whose memory came from the heap because `memory` had none left.
    heap_fallbacks: std::sync::atomic::AtomicUsize,
}

impl fmt::Debug for HostKvPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostKvPool")
            .field("page_bytes", &self.page_bytes)
            .field("pages", &self.slots.len())
            .field("free", &self.free_pages())
            .field("memory", &self.memory_kind())
            .finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl HostKvPool {
    /// A pool of `pages` slots of `page_bytes` each on the heap; memory is
    /// taken when a slot is first written.
    pub fn new(page_bytes: usize, pages: usize) -> Arc<Self> {
        Self::with_memory(page_bytes, pages, None)
    }

    /// As [`new`](Self::new), with each slot's memory from `memory` when
    /// given (the heap for a slot it has none left for).
    pub fn with_memory(
        page_bytes: usize,
        pages: usize,
        memory: Option<Arc<dyn HostMemory>>,
    ) -> Arc<Self> {
        let slots = (0..pages)
            .map(|_| {
                Mutex::new(Slot {
                    generation: 0,
                    filled: 0,
                    bytes: None,
                    held: 0,
                })
            })
            .collect();
        Arc::new(Self {
            page_bytes,
            slots,
            filled: Condvar::new(),
            free: Mutex::new((0..pages as u32).rev().collect()),
            memory,
            heap_fallbacks: Default::default(),
        })
    }

    /// What the slots' memory is: the [`HostMemory`]'s kind, or `heap`.
    pub fn memory_kind(&self) -> &'static str {
        self.memory.as_ref().map_or("heap", |m| m.kind())
    }

    /// Slots whose memory came from the heap although a [`HostMemory`] was given.
    pub fn heap_fallbacks(&self) -> usize {
        self.heap_fallbacks
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Memory for one page.
    fn page_memory(&self) -> Box<dyn HostRegion> {
        if let Some(m) = &self.memory {
            if let Some(r) = m
                .alloc(self.page_bytes)
                .filter(|r| r.bytes().len() == self.page_bytes)
            {
                return r;
            }
            if self
                .heap_fallbacks
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
                == 0
            {
                tracing::warn!(
                    "no {} host memory for a KV page of {} bytes; using the heap",
                    m.kind(),
                    self.page_bytes
                );
            }
        }
        Box::new(vec![0u8; self.page_bytes])
    }

    /// Bytes of one page.
    pub fn page_bytes(&self) -> usize {
        self.page_bytes
    }

    /// Slots in the pool.
    pub fn total_pages(&self) -> usize {
        self.slots.len()
    }

    /// Slots not allocated.
    pub fn free_pages(&self) -> usize {
        lock(&self.free).len()
    }

    /// Allocates `n` slots, or none when fewer are free.
    pub fn alloc(self: &Arc<Self>, n: usize) -> Option<HostPages> {
        let taken = {
            let mut free = lock(&self.free);
            if free.len() < n {
                return None;
            }
            let at = free.len() - n;
            free.split_off(at)
        };
        let mut slots = Vec::with_capacity(n);
        for s in taken.into_iter().rev() {
            let mut slot = lock(&self.slots[s as usize]);
            slot.generation += 1;
            slots.push(HostSlotRef {
                slot: s,
                generation: slot.generation,
            });
        }
        Some(HostPages {
            pool: self.clone(),
            slots,
        })
    }

    fn release(&self, slots: &[HostSlotRef]) {
        for s in slots {
            let mut slot = lock(&self.slots[s.slot as usize]);
            if slot.generation == s.generation {
                slot.filled = 0;
            }
        }
        lock(&self.free).extend(slots.iter().map(|s| s.slot));
    }

    /// Runs `f` on the bytes of `slot` to fill them with its page; false (and
    /// `f` not run) when the slot was freed since. The slot then reads as filled.
    pub fn write(&self, slot: HostSlotRef, f: impl FnOnce(&mut [u8])) -> bool {
        let Some(m) = self.slots.get(slot.slot as usize) else {
            return false;
        };
        let mut s = lock(m);
        // A held page is being read in place (a device copy in flight).
        while s.held > 0 && s.generation == slot.generation {
            s = match self.filled.wait(s) {
                Ok(g) => g,
                Err(e) => e.into_inner(),
            };
        }
        if s.generation != slot.generation {
            return false;
        }
        let bytes = s.bytes.get_or_insert_with(|| self.page_memory());
        f(bytes.bytes_mut());
        s.filled = slot.generation;
        drop(s);
        self.filled.notify_all();
        true
    }

    /// Runs `f` on the page in `slot` once it is filled; `None` when the slot
    /// is freed first or `timeout` passes.
    pub fn read<R>(
        &self,
        slot: HostSlotRef,
        timeout: Duration,
        f: impl FnOnce(&[u8]) -> R,
    ) -> Option<R> {
        let m = self.slots.get(slot.slot as usize)?;
        let deadline = Instant::now() + timeout;
        let mut s = lock(m);
        loop {
            if s.generation != slot.generation {
                return None;
            }
            if s.filled == slot.generation {
                return Some(f(s.page()));
            }
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            // Every slot shares the condvar; a spurious wake just re-checks.
            s = match self.filled.wait_timeout(s, deadline - now) {
                Ok((g, _)) => g,
                Err(e) => e.into_inner().0,
            };
        }
    }
}

impl HostKvPool {
    /// Runs `f` on the pages in `slots` (in that order; a slot may repeat)
    /// with every one of them locked, so none is freed or rewritten while
    /// `f` runs; `None` (and `f` not run) when one of them is freed or not
    /// filled. Slots are locked in ascending order, and every other method
    /// locks one slot at a time, so this cannot deadlock.
    pub fn read_many<R>(&self, slots: &[HostSlotRef], f: impl FnOnce(&[&[u8]]) -> R) -> Option<R> {
        let mut order: Vec<u32> = slots.iter().map(|s| s.slot).collect();
        order.sort_unstable();
        order.dedup();
        let mut guards = Vec::with_capacity(order.len());
        for &i in &order {
            guards.push(lock(self.slots.get(i as usize)?));
        }
        let mut pages = Vec::with_capacity(slots.len());
        for s in slots {
            let g = &guards[order.binary_search(&s.slot).ok()?];
            if g.generation != s.generation || g.filled != s.generation {
                return None;
            }
            pages.push(g.page());
        }
        Some(f(&pages))
    }
}

impl HostKvPool {
    /// Holds the pages in `slots` unchanged until the guard drops: a write
    /// to one of them waits (a device may read them in place meanwhile).
    /// `None`, holding nothing, when one of them is freed or not filled.
    pub fn hold(self: &Arc<Self>, slots: &[HostSlotRef]) -> Option<HeldSlots> {
        let mut held = HeldSlots {
            pool: self.clone(),
            slots: Vec::with_capacity(slots.len()),
        };
        for r in slots {
            let mut s = lock(self.slots.get(r.slot as usize)?);
            if s.generation != r.generation || s.filled != r.generation {
                return None;
            }
            s.held += 1;
            held.slots.push(r.slot);
        }
        Some(held)
    }
}

/// Pages held unchanged by [`HostKvPool::hold`]; released on drop.
pub struct HeldSlots {
    pool: Arc<HostKvPool>,
    slots: Vec<u32>,
}

impl HeldSlots {
    /// Whether `slot` is among the held ones.
    pub fn contains(&self, slot: u32) -> bool {
        self.slots.contains(&slot)
    }
}

impl Drop for HeldSlots {
    fn drop(&mut self) {
        for &i in &self.slots {
            if let Some(m) = self.pool.slots.get(i as usize) {
                let mut s = lock(m);
                s.held = s.held.saturating_sub(1);
            }
        }
        self.pool.filled.notify_all();
    }
}

/// One allocation of a host slot: the slot and its generation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostSlotRef {
    /// Index in the pool.
    pub slot: u32,
    /// Generation of the allocation.
    pub generation: u64,
}

/// Host slots owned together; returned to the pool on drop.
pub struct HostPages {
    pool: Arc<HostKvPool>,
    slots: Vec<HostSlotRef>,
}

impl fmt::Debug for HostPages {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list()
            .entries(self.slots.iter().map(|s| s.slot))
            .finish()
    }
}

impl HostPages {
    /// The slots, in page order.
    pub fn slots(&self) -> &[HostSlotRef] {
        &self.slots
    }

    /// Pages held.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// True when no page is held.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// The pool the slots belong to.
    pub fn pool(&self) -> &Arc<HostKvPool> {
        &self.pool
    }

    /// Splits off the pages from `at` on.
    pub fn split_off(&mut self, at: usize) -> HostPages {
        let at = at.min(self.slots.len());
        HostPages {
            pool: self.pool.clone(),
            slots: self.slots.split_off(at),
        }
    }
}

impl Drop for HostPages {
    fn drop(&mut self) {
        if !self.slots.is_empty() {
            self.pool.release(&self.slots);
        }
    }
}

/// Direction of a page copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyDirection {
    /// Device page to host slot (a backup or a demotion).
    ToHost,
    /// Host slot to device page (a load-back).
    ToDevice,
}

/// One page copied between the device and the host.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PageCopy {
    /// Which way.
    pub direction: CopyDirection,
    /// The device page.
    pub device_page: u32,
    /// The host slot.
    pub host: HostSlotRef,
}

/// The KV tier operations of a step: copies run in order before the forward
/// (a demoted page's copy precedes any load into the same device page).
#[derive(Clone, Debug, Default)]
pub struct KvTierOps {
    /// The host pool the copies use (`None` when there are none).
    pub host: Option<Arc<HostKvPool>>,
    /// Copies, in the order they must happen.
    pub copies: Vec<PageCopy>,
}

impl KvTierOps {
    /// True when the step copies nothing.
    pub fn is_empty(&self) -> bool {
        self.copies.is_empty()
    }

    /// Appends `other`'s copies after these.
    pub fn extend(&mut self, other: KvTierOps) {
        if self.host.is_none() {
            self.host = other.host;
        }
        self.copies.extend(other.copies);
    }
}

/// What the copies of a step cost.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct KvCopyStats {
    /// Pages copied to the host.
    pub pages_to_host: u64,
    /// Pages copied to the device.
    pub pages_to_device: u64,
    /// Bytes copied (both ways).
    pub bytes: u64,
    /// Seconds the copies took.
    pub seconds: f64,
}

impl KvCopyStats {
    /// Adds `other` to these counters.
    pub fn add(&mut self, other: &KvCopyStats) {
        self.pages_to_host += other.pages_to_host;
        self.pages_to_device += other.pages_to_device;
        self.bytes += other.bytes;
        self.seconds += other.seconds;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_chain_and_round_trip() {
        let spec = KvSpec {
            num_layers: 2,
            num_kv_heads: 1,
            head_dim: 4,
            page_size: 2,
            num_pages: 8,
            dtype: DType::F32,
            values_in_keys: false,
        };
        let id = TierIdentity::new("m", &spec);
        let root = id.root_key(&CacheNamespace::default());
        let keys = page_keys(root, &[1, 2, 3, 4, 5], 2);
        assert_eq!(keys.len(), 2);
        assert_eq!(keys[1], keys[0].next(&[3, 4]));
        assert_eq!(PageKey::from_hex(&keys[0].hex()), Some(keys[0]));
        let other = TierIdentity::new("m2", &spec).root_key(&CacheNamespace::default());
        assert_ne!(page_keys(other, &[1, 2], 2)[0], keys[0]);
        let ns = id.root_key(&CacheNamespace(Some("lora".into())));
        assert_ne!(ns, root);
        assert_eq!(id.page_bytes(), 2 * 2 * 2 * 4 * 4);
    }

    #[test]
    fn host_slots_free_on_drop_and_generations_guard_reuse() {
        let pool = HostKvPool::new(8, 3);
        let a = pool.alloc(2).expect("two free");
        assert_eq!(pool.free_pages(), 1);
        assert!(pool.alloc(2).is_none());
        let s = a.slots()[0];
        assert!(pool.write(s, |b| b.fill(7)));
        assert_eq!(pool.read(s, Duration::ZERO, |b| b[0]), Some(7));
        // Not yet filled: a read times out.
        assert_eq!(
            pool.read(a.slots()[1], Duration::from_millis(1), |b| b[0]),
            None
        );
        drop(a);
        assert_eq!(pool.free_pages(), 3);
        let b = pool.alloc(3).expect("all free");
        assert!(b.slots().iter().any(|r| r.slot == s.slot));
        assert_eq!(pool.read(s, Duration::ZERO, |b| b[0]), None);
        assert!(!pool.write(s, |_| {}));
    }

    /// Heap regions, counted; `limit` of them at most.
    struct Counted {
        given: std::sync::atomic::AtomicUsize,
        limit: usize,
    }

    impl HostMemory for Counted {
        fn alloc(&self, bytes: usize) -> Option<Box<dyn HostRegion>> {
            let n = self
                .given
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            (n < self.limit).then(|| Box::new(vec![0u8; bytes]) as Box<dyn HostRegion>)
        }
        fn kind(&self) -> &'static str {
            "counted"
        }
    }

    #[test]
    fn slots_take_memory_from_the_host_memory_then_the_heap() {
        let mem = Arc::new(Counted {
            given: Default::default(),
            limit: 2,
        });
        let pool = HostKvPool::with_memory(8, 3, Some(mem.clone()));
        assert_eq!(pool.memory_kind(), "counted");
        assert_eq!(HostKvPool::new(8, 1).memory_kind(), "heap");
        let a = pool.alloc(3).expect("three free");
        // Nothing is taken until a slot is written.
        assert_eq!(mem.given.load(std::sync::atomic::Ordering::Relaxed), 0);
        for (i, s) in a.slots().iter().enumerate() {
            assert!(pool.write(*s, |b| b.fill(i as u8 + 1)));
        }
        assert_eq!(mem.given.load(std::sync::atomic::Ordering::Relaxed), 3);
        assert_eq!(pool.heap_fallbacks(), 1);
        let firsts = pool.read_many(a.slots(), |p| {
            p.iter().map(|b| (b[0], b.len())).collect::<Vec<_>>()
        });
        assert_eq!(firsts, Some(vec![(1, 8), (2, 8), (3, 8)]));
        // A slot keeps its memory when freed and allocated again.
        drop(a);
        let b = pool.alloc(1).expect("one free");
        assert!(pool.write(b.slots()[0], |b| b.fill(9)));
        assert_eq!(mem.given.load(std::sync::atomic::Ordering::Relaxed), 3);
    }

    #[test]
    fn a_held_page_is_not_rewritten_until_released() {
        let pool = HostKvPool::new(4, 2);
        let a = pool.alloc(2).expect("two free");
        let [x, y] = [a.slots()[0], a.slots()[1]];
        assert!(pool.write(x, |b| b.fill(1)));
        // Not filled: nothing is held.
        assert!(pool.hold(&[x, y]).is_none());
        assert!(pool.write(y, |b| b.fill(2)));
        let held = pool.hold(&[x, y]).expect("both filled");
        assert!(held.contains(x.slot) && held.contains(y.slot));
        let writer = {
            let pool = pool.clone();
            std::thread::spawn(move || pool.write(x, |b| b.fill(7)))
        };
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(
            pool.read(x, Duration::ZERO, |b| b[0]),
            Some(1),
            "written while held"
        );
        drop(held);
        assert!(writer.join().expect("writer"));
        assert_eq!(pool.read(x, Duration::ZERO, |b| b[0]), Some(7));
        // A slot freed while held: the writer of its new allocation waits too,
        // and a write with the old generation is refused once released.
        let held = pool.hold(&[y]).expect("filled");
        drop(a);
        let b = pool.alloc(2).expect("both free");
        let again = b
            .slots()
            .iter()
            .copied()
            .find(|r| r.slot == y.slot)
            .expect("reused");
        let writer = {
            let pool = pool.clone();
            std::thread::spawn(move || pool.write(again, |b| b.fill(9)))
        };
        std::thread::sleep(Duration::from_millis(50));
        assert!(!writer.is_finished(), "a held slot was rewritten");
        drop(held);
        assert!(writer.join().expect("writer"));
        assert!(!pool.write(y, |_| {}));
    }

    #[test]
    fn read_many_sees_every_page_in_order_or_none() {
        let pool = HostKvPool::new(4, 4);
        let a = pool.alloc(3).expect("three free");
        let [x, y, z] = [a.slots()[0], a.slots()[1], a.slots()[2]];
        assert!(pool.write(x, |b| b.fill(1)));
        assert!(pool.write(y, |b| b.fill(2)));
        // A slot may repeat; the order is the caller's, not the slots'.
        let firsts = pool.read_many(&[y, x, y], |p| p.iter().map(|b| b[0]).collect::<Vec<_>>());
        assert_eq!(firsts, Some(vec![2, 1, 2]));
        // One page not filled: nothing runs.
        assert_eq!(pool.read_many(&[x, z], |_| ()), None);
        assert!(pool.write(z, |b| b.fill(3)));
        assert_eq!(pool.read_many(&[z, x], |p| p[0][0] + p[1][0]), Some(4));
        // A stale generation reads as gone.
        drop(a);
        let _b = pool.alloc(4).expect("all free");
        assert_eq!(pool.read_many(&[x], |_| ()), None);
        assert_eq!(pool.read_many(&[], |p| p.len()), Some(0));
    }
}
