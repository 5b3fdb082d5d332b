//! The paged KV layout the attention kernels read: one layer's K and V
//! storage ([`KvLayer`]) and the page arithmetic ([`page_of`],
//! [`pages_for`]). Token `t` of a sequence lives in slot
//! `page_table[page_of(t)] * page_size + t % page_size`. Pure data and
//! arithmetic: the cache (`crate::kv`) allocates and accounts the pages.

use crate::tensor::Tensor;

/// K and V storage of one layer. With [`KvSpec::values_in_keys`] `v` is
/// `k` (one buffer), and the attention writes and reads the same rows as
/// keys and as values.
#[derive(Clone, Debug)]
pub struct KvLayer {
    /// `[slots, kv_heads, head_dim]`.
    pub k: Tensor,
    /// `[slots, kv_heads, head_dim]`.
    pub v: Tensor,
}

impl KvLayer {
    /// Whether `v` is `k` (the same buffer and offset: a latent cache).
    pub fn values_in_keys(&self) -> bool {
        self.v.buffer_id() == self.k.buffer_id() && self.v.offset() == self.k.offset()
    }

    /// The tensors this layer stores, each once: K and V, or K alone when
    /// `v` is `k` (what page copies and transfers move).
    pub fn stored(&self) -> impl Iterator<Item = &Tensor> {
        std::iter::once(&self.k).chain((!self.values_in_keys()).then_some(&self.v))
    }
}

/// The page holding token `t` with pages of `page_size` tokens: a shift for
/// the usual power-of-two sizes (a division costs tens of cycles, and a
/// decode step takes a few per request).
#[inline]
pub fn page_of(t: usize, page_size: usize) -> usize {
    if page_size.is_power_of_two() {
        t >> page_size.trailing_zeros()
    } else {
        t / page_size
    }
}

/// Pages that hold `tokens` tokens (`tokens.div_ceil(page_size)`, see [`page_of`]).
#[inline]
pub fn pages_for(tokens: usize, page_size: usize) -> usize {
    page_of(tokens + page_size - 1, page_size)
}
