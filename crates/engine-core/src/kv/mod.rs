//! The paged KV cache: device storage and host-side page accounting.
//!
//! [`KvCache`] holds, for every layer, one K and one V tensor of
//! `num_pages * page_size` token slots (`[slots, kv_heads, head_dim]`). Token
//! `t` of a sequence lives in slot `page_table[t / page_size] * page_size +
//! t % page_size`.
//!
//! [`PagePool`] hands out page indices. A [`PageSet`] returns its pages to the
//! pool when dropped, so a page is owned by exactly one `PageSet` at a time and
//! can never leak or be freed twice. `used + free == total` always holds.
//!
//! [`KvDtypeChoice`] is what `--kv-cache-dtype` asks for: one element type,
//! or `auto`, which [`KvDtypeChoice::resolve`] turns into f16 on the CPU and
//! f32 on the other devices, with the reason for the start-up summary.
//!
//! The `kv` room holds everything the cache keeps, besides this module's
//! pages: [`state`] (the recurrent state slots of hybrid models),
//! [`prefix_cache`] (the prefix-cache trait and eviction policies),
//! [`tier`] (host and storage tiers), [`namespace`] (which requests may
//! share cached state) and [`no_prefix_cache`]. It depends on the device
//! room (`crate::backend`) and never the other way.

pub mod namespace;
pub mod no_prefix_cache;
pub mod prefix_cache;
pub mod state;
pub mod tier;
use crate::backend::Backend;
pub use crate::backend::paging::{KvLayer, page_of, pages_for};
use crate::dtype::DType;
use crate::error::{CoreError, Result};
use crate::kv::state::{StateCache, StateSpec};
use std::fmt;
use std::str::FromStr;
use std::sync::{Arc, Mutex, MutexGuard};

/// Shape of a KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvSpec {
    /// Transformer layers.
    pub num_layers: usize,
    /// KV heads per layer.
    pub num_kv_heads: usize,
    /// Dimension of one head.
    pub head_dim: usize,
    /// Tokens per page.
    pub page_size: usize,
    /// Pages in the pool.
    pub num_pages: usize,
    /// Element type of stored K and V.
    pub dtype: DType,
    /// Values are read from the keys: each layer stores one tensor, which
    /// is both (a latent cache, where one row per token serves as key and
    /// value: multi-head latent attention).
    pub values_in_keys: bool,
}

impl KvSpec {
    /// Tensors each layer stores: K and V, or K alone when the values are
    /// in the keys.
    pub fn tensors_per_layer(&self) -> usize {
        if self.values_in_keys { 1 } else { 2 }
    }
    /// Bytes of KV one token takes across all layers (K and V, or the one
    /// latent row).
    pub fn bytes_per_token(&self) -> usize {
        self.tensors_per_layer()
            * self.num_layers
            * self.num_kv_heads
            * self.head_dim
            * self.dtype.block_bytes()
            / self.dtype.block_size()
    }
    /// Token capacity of the pool.
    pub fn capacity_tokens(&self) -> usize {
        self.num_pages * self.page_size
    }
    /// Pages that fit in `bytes` of memory for this shape.
    pub fn pages_for_bytes(&self, bytes: u64) -> usize {
        let per_page = (self.bytes_per_token() * self.page_size) as u64;
        bytes.checked_div(per_page).unwrap_or(0) as usize
    }
}

/// The KV cache element type asked for (`--kv-cache-dtype`, `[model]
/// kv_cache_dtype`): `auto` or one of f32, f16, bf16 (and their long names).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KvDtypeChoice {
    /// f16 on the CPU backend when it stores f16 KV (half the memory of f32;
    /// its attention computes in f32 either way), f32 on every other device
    /// (what they used before `auto` existed).
    #[default]
    Auto,
    /// Exactly this element type.
    Exact(DType),
}

impl FromStr for KvDtypeChoice {
    type Err = CoreError;
    fn from_str(s: &str) -> Result<Self> {
        if s.eq_ignore_ascii_case("auto") {
            return Ok(Self::Auto);
        }
        // SGLang's spellings of the FP8 KV types.
        let s = match s.to_ascii_lowercase().as_str() {
            "fp8" | "fp8_e4m3" => "f8_e4m3".to_string(),
            "fp8_e5m2" => "f8_e5m2".to_string(),
            other => other.to_string(),
        };
        match s.parse::<DType>() {
            Ok(d @ (DType::F32 | DType::F16 | DType::BF16 | DType::F8E4M3 | DType::F8E5M2)) => {
                Ok(Self::Exact(d))
            }
            _ => Err(CoreError::Config(format!(
                "KV cache dtype must be auto, f32, f16, bf16, fp8_e4m3 or fp8_e5m2, got '{s}'"
            ))),
        }
    }
}

/// The KV element type a [`KvDtypeChoice`] comes to on one backend.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResolvedKvDtype {
    /// The element type the cache is allocated with.
    pub dtype: DType,
    /// Why, when `auto` chose it (`"auto: CPU"`); `None` when asked for.
    pub auto_reason: Option<String>,
}

impl fmt::Display for ResolvedKvDtype {
    /// `f16 (auto: CPU)`, or just `f32` when the dtype was asked for.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.auto_reason {
            Some(why) => write!(f, "{} ({why})", self.dtype),
            None => write!(f, "{}", self.dtype),
        }
    }
}

impl KvDtypeChoice {
    /// The element type on `backend` for a model whose checkpoint's KV
    /// scales were calibrated for `checkpoint` (`ModelSpec::checkpoint_kv_dtype`):
    /// an exact choice as it is (the cache refuses a dtype the backend does
    /// not list when it is allocated); `auto` is the checkpoint's type when
    /// the backend stores it (SGLang's `auto` with `kv_cache_quant_algo`
    /// FP8), else f16 on the `cpu` backend when its `kv_dtypes` list f16,
    /// else f32.
    pub fn resolve(self, backend: &dyn Backend, checkpoint: Option<DType>) -> ResolvedKvDtype {
        match self {
            Self::Exact(dtype) => ResolvedKvDtype {
                dtype,
                auto_reason: None,
            },
            Self::Auto => {
                let device = backend.info().backend;
                let kv_dtypes = &backend.capabilities().kv_dtypes;
                let f16 = kv_dtypes.contains(&DType::F16);
                let (dtype, why) = match (checkpoint, device == "cpu", f16) {
                    (Some(d), _, _) if kv_dtypes.contains(&d) => {
                        (d, "auto: the checkpoint's KV cache scales".to_string())
                    }
                    (_, true, true) => (DType::F16, "auto: CPU".to_string()),
                    (_, true, false) => (DType::F32, "auto: this CPU backend has no f16 KV".into()),
                    (_, false, _) => (DType::F32, format!("auto: f32 on {device}")),
                };
                ResolvedKvDtype {
                    dtype,
                    auto_reason: Some(why),
                }
            }
        }
    }
}

/// The device storage of the paged KV cache, and of the recurrent state
/// slots of a hybrid model's recurrent layers ([`StateCache`]) beside it.
#[derive(Debug)]
pub struct KvCache {
    spec: KvSpec,
    layers: Vec<KvLayer>,
    /// The recurrent layers' state slots, for a model that has them.
    state: Option<StateCache>,
    /// What `state` was allocated as (kept while released).
    state_shape: Option<(StateSpec, usize)>,
}

impl KvCache {
    /// Allocates K and V for every layer on `backend`.
    pub fn allocate(backend: &dyn Backend, spec: KvSpec) -> Result<Self> {
        if spec.page_size == 0 || spec.num_pages == 0 {
            return Err(CoreError::Config(format!(
                "KV cache needs page_size > 0 and num_pages > 0 (got {} and {})",
                spec.page_size, spec.num_pages
            )));
        }
        if !backend.capabilities().kv_dtypes.contains(&spec.dtype) {
            return Err(CoreError::unsupported(format!(
                "KV dtype {} on {}",
                spec.dtype,
                backend.info().backend
            )));
        }
        let shape = [spec.capacity_tokens(), spec.num_kv_heads, spec.head_dim];
        let mut layers = Vec::with_capacity(spec.num_layers);
        for _ in 0..spec.num_layers {
            let k = backend.alloc(spec.dtype, &shape)?;
            let v = if spec.values_in_keys {
                k.clone()
            } else {
                backend.alloc(spec.dtype, &shape)?
            };
            layers.push(KvLayer { k, v });
        }
        Ok(Self {
            spec,
            layers,
            state: None,
            state_shape: None,
        })
    }

    /// [`allocate`](Self::allocate), with `slots` recurrent state slots of
    /// `state` beside the pages when the model has recurrent layers.
    pub fn allocate_with_state(
        backend: &dyn Backend,
        spec: KvSpec,
        state: Option<(StateSpec, usize)>,
    ) -> Result<Self> {
        let mut kv = Self::allocate(backend, spec)?;
        if let Some((s, slots)) = state {
            kv.state = Some(StateCache::allocate(backend, s, slots)?);
            kv.state_shape = state;
        }
        Ok(kv)
    }

    /// The recurrent state slots (an error for a cache without them).
    pub fn state(&self) -> Result<&StateCache> {
        if self.is_released() {
            return Err(CoreError::invalid(
                "the KV cache is released (resume memory occupation first)",
            ));
        }
        self.state
            .as_ref()
            .ok_or_else(|| CoreError::invalid("this KV cache keeps no recurrent state"))
    }

    /// The state slots' shape and count, when the cache has them.
    pub fn state_shape(&self) -> Option<(StateSpec, usize)> {
        self.state_shape
    }
    /// The cache's shape.
    pub fn spec(&self) -> &KvSpec {
        &self.spec
    }
    /// Storage of layer `i`.
    pub fn layer(&self, i: usize) -> Result<&KvLayer> {
        if self.is_released() {
            return Err(CoreError::invalid(
                "the KV cache is released (resume memory occupation first)",
            ));
        }
        self.layers
            .get(i)
            .ok_or_else(|| CoreError::invalid(format!("KV layer {i} out of range")))
    }

    /// A cache of `spec`'s shape holding no memory (released); every layer
    /// access fails until it is allocated again.
    pub fn released(spec: KvSpec) -> Self {
        Self {
            spec,
            layers: Vec::new(),
            state: None,
            state_shape: None,
        }
    }

    /// A released cache of this one's shape, state slots included.
    pub fn released_like(&self) -> Self {
        Self {
            state_shape: self.state_shape,
            ..Self::released(self.spec)
        }
    }

    /// Whether this cache holds no memory.
    pub fn is_released(&self) -> bool {
        self.layers.is_empty() && self.spec.num_layers > 0
    }
}

struct PoolState {
    free: Vec<u32>,
    total: usize,
}

/// Hands out KV page indices. Cloning shares the same pool.
#[derive(Clone)]
pub struct PagePool {
    state: Arc<Mutex<PoolState>>,
    page_size: usize,
}

impl fmt::Debug for PagePool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "PagePool(free {}/{} pages of {})",
            self.free_pages(),
            self.total_pages(),
            self.page_size
        )
    }
}

impl PagePool {
    /// A pool of `num_pages` pages of `page_size` tokens.
    pub fn new(num_pages: usize, page_size: usize) -> Self {
        // Hand out low indices first: pop() takes from the end.
        let free: Vec<u32> = (0..num_pages as u32).rev().collect();
        Self {
            state: Arc::new(Mutex::new(PoolState {
                free,
                total: num_pages,
            })),
            page_size,
        }
    }

    fn lock(&self) -> MutexGuard<'_, PoolState> {
        // A poisoned pool only means another thread panicked mid-operation;
        // every operation leaves the state consistent, so keep going.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Tokens per page.
    pub fn page_size(&self) -> usize {
        self.page_size
    }
    /// Pages in the pool.
    pub fn total_pages(&self) -> usize {
        self.lock().total
    }
    /// Pages not owned by any [`PageSet`].
    pub fn free_pages(&self) -> usize {
        self.lock().free.len()
    }
    /// Pages owned by some [`PageSet`].
    pub fn used_pages(&self) -> usize {
        let s = self.lock();
        s.total - s.free.len()
    }
    /// Pages needed for `tokens` tokens.
    pub fn pages_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.page_size)
    }

    /// Takes `n` pages, or none and an error if fewer are free.
    pub fn alloc(&self, n: usize) -> Result<PageSet> {
        let mut s = self.lock();
        if s.free.len() < n {
            return Err(CoreError::OutOfMemory(format!(
                "KV pool has {} free pages, {n} requested",
                s.free.len()
            )));
        }
        let at = s.free.len() - n;
        let pages = s.free.split_off(at);
        drop(s);
        Ok(PageSet {
            pages,
            pool: Some(self.clone()),
        })
    }

    /// An empty set bound to this pool.
    pub fn empty_set(&self) -> PageSet {
        PageSet {
            pages: Vec::new(),
            pool: Some(self.clone()),
        }
    }

    fn release(&self, pages: &[u32]) {
        if pages.is_empty() {
            return;
        }
        let mut s = self.lock();
        s.free.extend_from_slice(pages);
        debug_assert!(s.free.len() <= s.total, "page freed twice");
    }

    fn same_pool(&self, other: &PagePool) -> bool {
        Arc::ptr_eq(&self.state, &other.state)
    }
}

/// Pages owned by one holder (a request, a radix node). Returned to the pool on drop.
pub struct PageSet {
    pages: Vec<u32>,
    pool: Option<PagePool>,
}

impl fmt::Debug for PageSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PageSet{:?}", self.pages)
    }
}

impl PageSet {
    /// The page indices, in sequence order.
    pub fn pages(&self) -> &[u32] {
        &self.pages
    }
    /// Number of pages.
    pub fn len(&self) -> usize {
        self.pages.len()
    }
    /// True if no pages are held.
    pub fn is_empty(&self) -> bool {
        self.pages.is_empty()
    }
    /// Splits off pages `at..`, which the returned set owns.
    pub fn split_off(&mut self, at: usize) -> PageSet {
        let at = at.min(self.pages.len());
        PageSet {
            pages: self.pages.split_off(at),
            pool: self.pool.clone(),
        }
    }
    /// Moves all pages of `other` to the end of this set. Errors if the pools differ.
    pub fn append(&mut self, mut other: PageSet) -> Result<()> {
        match (&self.pool, &other.pool) {
            (Some(a), Some(b)) if !a.same_pool(b) => {
                return Err(CoreError::Internal(
                    "appending pages of another pool".into(),
                ));
            }
            (None, Some(_)) => self.pool = other.pool.clone(),
            _ => {}
        }
        self.pages.append(&mut other.pages);
        Ok(())
    }
    /// Returns all pages to the pool now.
    pub fn release(mut self) {
        self.free_now();
    }
    fn free_now(&mut self) {
        if let Some(pool) = &self.pool {
            pool.release(&self.pages);
        }
        self.pages.clear();
    }
}

impl Drop for PageSet {
    fn drop(&mut self) {
        self.free_now();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_latent_cache_stores_one_tensor_per_layer() {
        let spec = KvSpec {
            num_layers: 61,
            num_kv_heads: 1,
            head_dim: 576,
            page_size: 64,
            num_pages: 4,
            dtype: DType::BF16,
            values_in_keys: true,
        };
        // DeepSeek-V3's latent (512 + 64) in bf16: 61 x 576 x 2 bytes.
        assert_eq!(spec.tensors_per_layer(), 1);
        assert_eq!(spec.bytes_per_token(), 61 * 576 * 2);
        let both = KvSpec {
            values_in_keys: false,
            ..spec
        };
        assert_eq!(both.bytes_per_token(), 2 * spec.bytes_per_token());
        assert_eq!(
            spec.pages_for_bytes(1 << 30),
            2 * both.pages_for_bytes(1 << 30)
        );
    }

    #[test]
    fn page_arithmetic_matches_division() {
        for ps in [1, 3, 16, 24, 64, 100] {
            for t in 0..500 {
                assert_eq!(page_of(t, ps), t / ps, "page_of({t}, {ps})");
                assert_eq!(pages_for(t, ps), t.div_ceil(ps), "pages_for({t}, {ps})");
            }
        }
    }

    #[test]
    fn kv_dtype_choice_parses_auto_and_the_float_types() {
        assert_eq!(
            "auto".parse::<KvDtypeChoice>().unwrap(),
            KvDtypeChoice::Auto
        );
        assert_eq!(
            "AUTO".parse::<KvDtypeChoice>().unwrap(),
            KvDtypeChoice::Auto
        );
        for (s, d) in [
            ("f32", DType::F32),
            ("f16", DType::F16),
            ("half", DType::F16),
            ("bf16", DType::BF16),
            ("bfloat16", DType::BF16),
            ("fp8_e4m3", DType::F8E4M3),
            ("fp8", DType::F8E4M3),
            ("FP8_E5M2", DType::F8E5M2),
            ("f8_e5m2", DType::F8E5M2),
        ] {
            assert_eq!(s.parse::<KvDtypeChoice>().unwrap(), KvDtypeChoice::Exact(d));
        }
        for bad in ["fp4", "q4_0", "", "f64", "u4_s32"] {
            let e = bad.parse::<KvDtypeChoice>().unwrap_err().to_string();
            assert!(
                e.contains("auto, f32, f16, bf16, fp8_e4m3 or fp8_e5m2"),
                "{bad}: {e}"
            );
        }
        let asked = ResolvedKvDtype {
            dtype: DType::F32,
            auto_reason: None,
        };
        assert_eq!(asked.to_string(), "f32");
        let auto = ResolvedKvDtype {
            dtype: DType::F16,
            auto_reason: Some("auto: CPU".into()),
        };
        assert_eq!(auto.to_string(), "f16 (auto: CPU)");
    }

    #[test]
    fn pages_return_on_drop() {
        let pool = PagePool::new(10, 4);
        let mut a = pool.alloc(6).unwrap();
        assert_eq!(pool.free_pages(), 4);
        assert!(pool.alloc(5).is_err());
        assert_eq!(pool.free_pages(), 4, "failed alloc takes nothing");
        let tail = a.split_off(4);
        assert_eq!(tail.len(), 2);
        drop(tail);
        assert_eq!(pool.free_pages(), 6);
        let b = pool.alloc(1).unwrap();
        a.append(b).unwrap();
        assert_eq!(a.len(), 5);
        drop(a);
        assert_eq!(pool.free_pages(), 10);
        assert_eq!(pool.pages_for(9), 3);
    }

    #[test]
    fn append_refuses_other_pool() {
        let p1 = PagePool::new(2, 1);
        let p2 = PagePool::new(2, 1);
        let mut a = p1.alloc(1).unwrap();
        let b = p2.alloc(1).unwrap();
        assert!(a.append(b).is_err());
        drop(a);
        assert_eq!(p1.free_pages(), 2);
        assert_eq!(p2.free_pages(), 2);
    }
}
