//! Prefill/decode disaggregation on a worker: the prefill side.
//!
//! A request carrying `x-arbor-kv-peer: HOST:PORT` (the router adds it) on
//! a worker started with `--disaggregation-mode prefill` computes its
//! prompts and one token each (`max_new_tokens` becomes 1); once the run
//! finished, the KV of each prompt's cached prefix is exported and sent to
//! the decode worker's transfer engine at that address, and the response
//! ends only after the decode side imported it (or the transfer failed,
//! which the decode side absorbs by computing the prefix itself). The
//! decode side needs nothing per request: its transfer engine imports the
//! pages into its prefix cache, where the request then matches them.

use crate::error::ApiError;
use crate::run::Job;
use crate::state::AppState;
use arbor_engine_core::CacheNamespace;
use arbor_engine_core::engine::transfer::TransferReport;
use arbor_engine_core::lora::LoraAdapter;
use axum::http::HeaderMap;
use std::sync::Arc;

/// The header naming the decode worker's KV transfer address.
pub const PEER_HEADER: &str = "x-arbor-kv-peer";

/// The prompts of a run whose KV goes to a decode worker when it finished.
pub(crate) struct PrefillExport {
    peer: String,
    prompts: Vec<(Vec<u32>, CacheNamespace, Option<Arc<LoraAdapter>>)>,
}

/// Reads the peer header; on a prefill worker, turns `jobs` into prefill
/// jobs and returns what to export once they finished.
pub(crate) fn prefill_jobs(
    st: &AppState,
    headers: &HeaderMap,
    jobs: &mut [Job],
) -> Result<Option<PrefillExport>, ApiError> {
    let Some(v) = headers.get(PEER_HEADER) else {
        return Ok(None);
    };
    if st.kv_transfer.is_none() {
        return Err(ApiError::bad_request(format!(
            "{PEER_HEADER}: this worker is not a prefill worker (start it with --disaggregation-mode prefill)"
        )));
    }
    let peer = v
        .to_str()
        .ok()
        .filter(|p| {
            p.rsplit_once(':')
                .is_some_and(|(h, port)| !h.is_empty() && port.parse::<u16>().is_ok())
        })
        .ok_or_else(|| ApiError::bad_request(format!("{PEER_HEADER} must be HOST:PORT")))?
        .to_string();
    let mut prompts = Vec::with_capacity(jobs.len());
    for j in jobs.iter_mut() {
        if j.params.n > 1 {
            return Err(ApiError::bad_param(
                "n",
                "a disaggregated prefill runs one sample per prompt",
            ));
        }
        j.params.max_new_tokens = 1;
        j.params.min_new_tokens = j.params.min_new_tokens.min(1);
        prompts.push((j.input_ids.clone(), j.namespace.clone(), j.lora.clone()));
    }
    Ok(Some(PrefillExport { peer, prompts }))
}

impl PrefillExport {
    /// Exports and sends every prompt's KV; one report per prompt (an error
    /// text for a prompt whose transfer failed).
    pub(crate) async fn send(self, st: Arc<AppState>) -> Vec<Result<TransferReport, String>> {
        let Some(tx) = st.kv_transfer.clone() else {
            return Vec::new();
        };
        let engine = st.engine.clone();
        let peer = self.peer;
        let prompts = self.prompts;
        let work = tokio::task::spawn_blocking(move || {
            prompts
                .iter()
                .map(|(ids, ns, lora)| {
                    let pages = engine
                        .export_kv(ids, ns, lora.as_ref())
                        .map_err(|e| e.to_string())?;
                    tx.send(&peer, &pages).map_err(|e| e.to_string())
                })
                .collect::<Vec<_>>()
        });
        let reports = work
            .await
            .unwrap_or_else(|e| vec![Err(format!("KV transfer task failed: {e}"))]);
        for r in &reports {
            match r {
                Ok(t) => {
                    st.metrics.kv_transferred(t);
                    tracing::debug!(
                        "sent {} tokens of KV ({} bytes) in {:.3} s",
                        t.tokens,
                        t.bytes,
                        t.seconds
                    );
                }
                Err(e) => {
                    st.metrics.kv_transfer_failed();
                    tracing::warn!(
                        "KV transfer failed: {e}; the decode worker computes the prompt itself"
                    );
                }
            }
        }
        reports
    }
}
