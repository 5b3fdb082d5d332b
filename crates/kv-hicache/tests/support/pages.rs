//! Test pages for the storage backends: distinct keys, deterministic page
//! contents of an identity's page size, and `(key, bytes)` batches.
#![allow(dead_code)]

use arbor_engine_core::{PageKey, TierIdentity};

/// The `i`-th test key.
pub fn key(i: u32) -> PageKey {
    PageKey([0u8; 32]).next(&[i])
}

/// A page of `id`'s size filled from `seed` (xorshift bytes).
pub fn page(id: &TierIdentity, seed: u32) -> Vec<u8> {
    let mut x = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
    (0..id.page_bytes())
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x as u8
        })
        .collect()
}

/// `keys` paired with `pages`, as `KvTier::set` takes them.
pub fn entries<'a>(keys: &[PageKey], pages: &'a [Vec<u8>]) -> Vec<(PageKey, &'a [u8])> {
    keys.iter()
        .copied()
        .zip(pages.iter().map(|p| &p[..]))
        .collect()
}
