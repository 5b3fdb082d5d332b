//! KV transfer between engines, for prefill/decode disaggregation: one
//! engine exports the KV pages of a cached token prefix, another imports
//! them into its own prefix cache, and a request there then matches the
//! prefix instead of computing it.
//!
//! - [`Engine::export_kv`]: between steps, matches `tokens` in the prefix
//!   cache (whole pages; a host-tier hit is loaded back first), copies the
//!   matched pages to host memory in the host-tier layout (per layer the
//!   page's K bytes then its V bytes) and returns them as [`KvPages`]. The
//!   match is locked while the copy runs, so no page is evicted under it.
//! - [`Engine::import_kv`]: between steps, checks that the pages were made
//!   by an engine of the same layout ([`KvPages::layout`]), takes device
//!   pages from the pool (evicting unlocked cache entries if needed), writes
//!   the bytes and inserts the tokens into the prefix cache, which owns the
//!   pages from then on (evictable, freed by a flush). Pages already cached
//!   are freed again by the insert.
//! - [`KvTransfer`]: how pages travel from one engine to another (TCP in
//!   crates/kv-transfer; NIXL or Mooncake's transfer engine fit the same
//!   trait). The receiving side hands what arrives to `import_kv`. Two
//!   directions: `send` pushes pages to a decode worker's receiver (Arbor's
//!   router, which names the receiver per request), and `pull` fetches
//!   them from a prefill worker's [`KvRooms`] by bootstrap room (SGLang's
//!   router, which sends the request to both workers at once with
//!   `bootstrap_host`, `bootstrap_port` and `bootstrap_room`). A room
//!   holds a [`Prefilled`]: the pages and the prefill's first output token,
//!   which the decode worker's request starts from.
//!
//! Namespaces travel with the pages unversioned; each engine salts them
//! with its own weight version, so pages never cross a weight update.
//!
//! With data parallelism an export asks every rank and takes the longest
//! match (any rank may have served the prompt); an import goes to the rank
//! the load balance picks, and later requests of that prefix follow it
//! there (the dispatcher's import affinity), so they match it.

use super::{Engine, Msg, data_parallel};
use crate::error::{CoreError, Result};
use crate::kv::prefix_cache::CacheNamespace;
use crate::model::lora::LoraAdapter;
use std::sync::{Arc, mpsc};

/// The KV of a token prefix, in whole pages (see the module doc).
#[derive(Clone, PartialEq, Eq)]
pub struct KvPages {
    /// Digest of the exporter's KV layout (model shape, KV dtype, page
    /// size): an importer with another layout refuses the pages.
    pub layout: [u8; 32],
    /// Tokens per page.
    pub page_size: usize,
    /// Bytes per page.
    pub page_bytes: usize,
    /// The cache namespace (before weight versioning).
    pub namespace: CacheNamespace,
    /// The prefix, `pages.len() * page_size` tokens.
    pub tokens: Vec<u32>,
    /// One entry of `page_bytes` per page.
    pub pages: Vec<Vec<u8>>,
}

impl std::fmt::Debug for KvPages {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvPages")
            .field("page_size", &self.page_size)
            .field("page_bytes", &self.page_bytes)
            .field("namespace", &self.namespace)
            .field("tokens", &self.tokens.len())
            .field("pages", &self.pages.len())
            .finish()
    }
}

impl KvPages {
    /// Bytes of KV carried.
    pub fn bytes(&self) -> usize {
        self.pages.len() * self.page_bytes
    }

    /// Whether the shape is consistent (token count, page sizes).
    pub fn check(&self) -> Result<()> {
        if self.page_size == 0 || self.tokens.len() != self.pages.len() * self.page_size {
            return Err(CoreError::invalid(format!(
                "KV pages: {} tokens do not fill {} pages of {}",
                self.tokens.len(),
                self.pages.len(),
                self.page_size
            )));
        }
        if let Some(p) = self.pages.iter().find(|p| p.len() != self.page_bytes) {
            return Err(CoreError::invalid(format!(
                "KV pages: a page of {} bytes, expected {}",
                p.len(),
                self.page_bytes
            )));
        }
        Ok(())
    }
}

/// What a prefill worker hands a decode worker for one prompt through a
/// bootstrap room: the KV of the prompt's cached whole-page prefix and,
/// when the prefill sampled one, the first output token, so the decode
/// worker starts from that token instead of recomputing the prompt's last
/// position ([`crate::engine::GenerateRequest::first_token`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Prefilled {
    /// The KV of the prompt's cached whole-page prefix.
    pub pages: KvPages,
    /// The first output token and the rest of the prompt it followed.
    pub first: Option<FirstToken>,
}

/// The token a prefill sampled after a prompt of which [`KvPages::tokens`]
/// is the cached prefix.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FirstToken {
    /// The prompt's tokens after the pages' tokens (its partial last page,
    /// or more when part of it was not cached).
    pub prompt_tail: Vec<u32>,
    /// The sampled token.
    pub token: u32,
}

impl Prefilled {
    /// Pages alone, without a first token.
    pub fn pages(pages: KvPages) -> Self {
        Self { pages, first: None }
    }

    /// The first token if it followed exactly `prompt` (a decode worker
    /// uses it only for the prompt the prefill ran).
    pub fn first_token_for(&self, prompt: &[u32]) -> Option<u32> {
        let first = self.first.as_ref()?;
        let head = self.pages.tokens.len();
        (prompt.len() == head + first.prompt_tail.len()
            && prompt[..head] == self.pages.tokens[..]
            && prompt[head..] == first.prompt_tail[..])
            .then_some(first.token)
    }
}

/// What one transfer moved.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct TransferReport {
    /// Tokens the receiving engine now caches from the transfer.
    pub tokens: usize,
    /// Bytes sent.
    pub bytes: usize,
    /// Seconds from the start of sending to the receiver's answer.
    pub seconds: f64,
}

/// Why a transfer failed (the receiver then computes the prefix itself).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransferError {
    /// The peer address is not usable.
    #[error("bad KV transfer peer {0:?}")]
    BadPeer(String),
    /// The peer could not be reached or the connection broke.
    #[error("KV transfer I/O: {0}")]
    Io(String),
    /// The peer refused the pages (another layout, no memory, ...).
    #[error("KV transfer refused by the peer: {0}")]
    Refused(String),
    /// What arrived is not a valid transfer.
    #[error("KV transfer protocol: {0}")]
    Protocol(String),
}

/// Moves KV pages to another engine.
pub trait KvTransfer: Send + Sync {
    /// Registered name (`tcp`).
    fn name(&self) -> &str;
    /// Sends `pages` to the engine listening at `peer` and waits until it
    /// imported them.
    fn send(
        &self,
        peer: &str,
        pages: &KvPages,
    ) -> std::result::Result<TransferReport, TransferError>;
    /// Fetches the pages a prefill worker holds for bootstrap room `room`
    /// (SGLang's `bootstrap_room`) from its bootstrap address `peer`,
    /// waiting until they are there or the peer gives up on them.
    fn pull(&self, peer: &str, room: u64) -> std::result::Result<Prefilled, TransferError>;
}

/// A prefill worker's bootstrap rooms (SGLang's bootstrap server): each
/// room holds one request's exported KV until the decode worker named by
/// the router pulls it, or until it expires.
pub trait KvRooms: Send + Sync {
    /// The address decode workers pull from (`HOST:PORT`).
    fn address(&self) -> String;
    /// Deposits room `room`'s prefill, or why it has none (the decode
    /// worker then computes the prompt itself).
    fn put(&self, room: u64, prefilled: std::result::Result<Prefilled, String>);
}

/// Messages of this module to the scheduler thread.
pub(crate) enum TransferOp {
    Export {
        namespace: CacheNamespace,
        tokens: Vec<u32>,
        reply: mpsc::Sender<Result<KvPages>>,
    },
    Import {
        pages: KvPages,
        reply: mpsc::Sender<Result<usize>>,
    },
}

/// The namespace a request with `namespace` and `lora` runs in (before
/// weight versioning).
pub(crate) fn request_namespace(
    namespace: &CacheNamespace,
    lora: Option<&Arc<LoraAdapter>>,
) -> CacheNamespace {
    match lora {
        Some(a) => namespace.with_adapter(a.digest()),
        None => namespace.clone(),
    }
}

impl Engine {
    /// Runs a transfer on rank `rank`'s scheduler.
    fn transfer<T>(
        &self,
        rank: usize,
        make: impl FnOnce(mpsc::Sender<Result<T>>) -> TransferOp,
    ) -> Result<T> {
        let (tx, rx) = mpsc::channel();
        self.ranks[rank]
            .tx
            .send(Msg::Transfer(make(tx)))
            .map_err(|_| CoreError::Internal("the scheduler has stopped".into()))?;
        rx.recv()
            .map_err(|_| CoreError::Internal("the scheduler stopped before answering".into()))?
    }

    /// The cached whole-page prefix of `tokens` of a request with
    /// `namespace` and `lora`, as pages (see the module doc).
    pub fn export_kv(
        &self,
        tokens: &[u32],
        namespace: &CacheNamespace,
        lora: Option<&Arc<LoraAdapter>>,
    ) -> Result<KvPages> {
        let namespace = request_namespace(namespace, lora);
        // With data parallelism any rank may have served the prompt: the
        // longest match wins (an error only when every rank failed).
        let mut best: Option<Result<KvPages>> = None;
        for rank in 0..self.ranks.len() {
            let r = self.transfer(rank, |reply| TransferOp::Export {
                namespace: namespace.clone(),
                tokens: tokens.to_vec(),
                reply,
            });
            best = match (best, r) {
                (Some(Ok(b)), Ok(p)) if p.tokens.len() <= b.tokens.len() => Some(Ok(b)),
                (Some(Ok(b)), Err(_)) => Some(Ok(b)),
                (Some(Err(e)), Err(_)) => Some(Err(e)),
                (_, r) => Some(r),
            };
        }
        best.unwrap_or_else(|| Err(CoreError::Internal("an engine of no ranks".into())))
    }

    /// Caches `pages` (see the module doc); returns the tokens now cached
    /// from them.
    ///
    /// With data parallelism the pages go to the rank the load balance
    /// picks, and requests whose prompt starts with their tokens go to that
    /// rank from then on (`ImportAffinity` in `engine::data_parallel`).
    pub fn import_kv(&self, pages: KvPages) -> Result<usize> {
        self.import_kv_on(pages, None)
    }

    /// [`Engine::import_kv`] on data-parallel rank `rank` (the
    /// `data_parallel_rank` of the request the pages are for, which will
    /// run there); `None`: the load balance picks.
    pub fn import_kv_on(&self, pages: KvPages, rank: Option<usize>) -> Result<usize> {
        pages.check()?;
        if let Some(r) = rank {
            self.check_dp_rank(r)?;
        }
        if self.ranks.len() == 1 {
            return self.transfer(0, |reply| TransferOp::Import { pages, reply });
        }
        let rank = rank.unwrap_or_else(|| {
            let loads: Vec<&data_parallel::RankLoad> =
                self.ranks.iter().map(|r| &*r.load).collect();
            self.dispatcher.pick(&loads)
        });
        let (namespace, tokens) = (pages.namespace.clone(), pages.tokens.clone());
        let cached = self.transfer(rank, |reply| TransferOp::Import { pages, reply })?;
        if cached > 0 {
            self.dispatcher.imported(&namespace, &tokens, rank);
        }
        Ok(cached)
    }
}
