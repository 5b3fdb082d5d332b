//! The cache namespace of a request: requests share cached prefixes only
//! within one namespace (SGLang's `extra_key` and `cache_salt`, and the
//! LoRA adapter a request runs with). Used by the prefix cache, its tiers
//! (storage keys) and the engine; it depends on nothing else.

/// Requests in different namespaces never share cached KV (LoRA adapter, tenant salt).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CacheNamespace(pub Option<String>);

impl CacheNamespace {
    /// The namespace of a request with these keys.
    pub fn new(extra_key: Option<&str>, cache_salt: Option<&str>) -> Self {
        match (extra_key, cache_salt) {
            (None, None) => CacheNamespace(None),
            (a, b) => CacheNamespace(Some(format!(
                "{}\u{1f}{}",
                a.unwrap_or_default(),
                b.unwrap_or_default()
            ))),
        }
    }

    /// This namespace under a LoRA adapter whose files hash to `digest`:
    /// KV computed with an adapter is reused only by requests with the same
    /// adapter (and the same keys).
    pub fn with_adapter(&self, digest: &str) -> Self {
        CacheNamespace(Some(format!(
            "lora:{digest}\u{1f}{}",
            self.0.as_deref().unwrap_or_default()
        )))
    }
}
