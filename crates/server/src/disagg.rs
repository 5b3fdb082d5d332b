//! Prefill/decode disaggregation on a worker.
//!
//! Two flows, one per router:
//! - **Arbor's router** names the decode worker: a request carrying
//!   `x-arbor-kv-peer: HOST:PORT` on a prefill worker computes its prompts
//!   and one token each (`RequestKind::PrefillForExport`); once the run
//!   finished, each prompt's cached prefix is exported and sent to that
//!   decode worker's transfer engine, and the response ends only after the
//!   decode side imported it. The decode side needs nothing per request.
//! - **SGLang's router** sends the request to both workers at once with
//!   `bootstrap_host`, `bootstrap_port` and `bootstrap_room` (one room per
//!   prompt). The prefill worker computes the prompts (one token each) and
//!   deposits each prompt's KV in its room ([`KvRooms`]); the decode worker
//!   first pulls each room from `bootstrap_host:bootstrap_port` and imports
//!   it, then runs the request, which matches the imported prefix. The room
//!   also carries the first token the prefill sampled: the decode request
//!   starts from it (streamed at once) and computes that token's position,
//!   not the prompt's last one again.
//!
//! A transfer that fails costs time, never the request: the decode worker
//! computes whatever did not arrive. A prefill whose request is refused
//! still answers the rooms, with the reason, so no decode worker waits for
//! KV that will not come.

use crate::error::ApiError;
use crate::fields::Fields;
use crate::run::Job;
use crate::state::AppState;
use arbor_engine_core::CacheNamespace;
use arbor_engine_core::engine::RequestKind;
use arbor_engine_core::engine::transfer::{
    FirstToken, KvPages, KvRooms, KvTransfer, Prefilled, TransferReport,
};
use arbor_engine_core::lora::LoraAdapter;
use axum::http::HeaderMap;
use serde_json::Value;
use std::sync::Arc;

/// The header naming the decode worker's KV transfer address.
pub const PEER_HEADER: &str = "x-arbor-kv-peer";

/// This worker's part in a disaggregated deployment.
#[derive(Clone)]
pub enum Disagg {
    /// Computes prompts and hands their KV on: pushed through `transfer` to
    /// the decode worker a request names, or deposited in its bootstrap room.
    Prefill {
        transfer: Arc<dyn KvTransfer>,
        rooms: Arc<dyn KvRooms>,
    },
    /// Generates; pulls a request's KV from its bootstrap room first.
    Decode { transfer: Arc<dyn KvTransfer> },
}

/// Where a prompt's KV comes from or goes to (SGLang's bootstrap fields).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Bootstrap {
    /// The prefill worker's host.
    pub host: String,
    /// Its bootstrap port (`None`: the router knows none; nothing is pulled).
    pub port: Option<u16>,
    /// The room, unique per prompt.
    pub room: u64,
}

/// One of the three bootstrap fields for prompt `i` of `count`: a list has
/// one entry per prompt (or per sample of a single prompt, whose first
/// entry is used); a single value serves a single prompt.
fn entry(key: &str, v: &Option<Value>, i: usize, count: usize) -> Result<Option<Value>, ApiError> {
    Ok(match v {
        None => None,
        Some(Value::Array(a)) if a.len() == count || (count == 1 && !a.is_empty()) => {
            a.get(i).cloned().filter(|x| !x.is_null())
        }
        Some(Value::Array(a)) => {
            return Err(ApiError::bad_param(
                key,
                format!("'{key}' has {} entries for {count} prompts", a.len()),
            ));
        }
        Some(_) if count > 1 => {
            return Err(ApiError::bad_param(
                key,
                format!("'{key}' must be a list with one entry per prompt"),
            ));
        }
        Some(x) => Some(x.clone()),
    })
}

/// Reads SGLang's bootstrap fields for `count` prompts.
pub(crate) fn bootstrap_fields(
    f: &mut Fields,
    count: usize,
) -> Result<Vec<Option<Bootstrap>>, ApiError> {
    let (host, port, room) = (
        f.raw("bootstrap_host"),
        f.raw("bootstrap_port"),
        f.raw("bootstrap_room"),
    );
    if room.is_none() {
        return Ok(vec![None; count]);
    }
    (0..count)
        .map(|i| {
            let Some(room) = entry("bootstrap_room", &room, i, count)? else {
                return Ok(None);
            };
            let room = room
                .as_u64()
                .filter(|&r| r <= i64::MAX as u64)
                .ok_or_else(|| {
                    ApiError::bad_param(
                        "bootstrap_room",
                        "'bootstrap_room' must be an integer in [0, 2^63)",
                    )
                })?;
            let host = entry("bootstrap_host", &host, i, count)?
                .and_then(|h| h.as_str().map(str::to_string))
                .filter(|h| !h.is_empty())
                .ok_or_else(|| {
                    ApiError::bad_param(
                        "bootstrap_host",
                        "'bootstrap_room' needs 'bootstrap_host', the prefill worker's host",
                    )
                })?;
            let port = match entry("bootstrap_port", &port, i, count)? {
                None => None,
                Some(p) => Some(p.as_u64().and_then(|p| u16::try_from(p).ok()).ok_or_else(
                    || {
                        ApiError::bad_param(
                            "bootstrap_port",
                            "'bootstrap_port' must be a port number",
                        )
                    },
                )?),
            };
            Ok(Some(Bootstrap { host, port, room }))
        })
        .collect()
}

/// Where an exported prompt's KV goes.
enum Destination {
    /// Pushed to this decode worker's receiver.
    Peer(String),
    /// Deposited in each prompt's room.
    Rooms(Arc<dyn KvRooms>),
}

/// One prompt of a prefill run whose KV is handed on once it finished.
struct Exported {
    ids: Vec<u32>,
    namespace: CacheNamespace,
    lora: Option<Arc<LoraAdapter>>,
    room: Option<u64>,
}

/// The prompts of a run whose KV goes to a decode worker when it finished.
pub(crate) struct PrefillExport {
    dest: Destination,
    prompts: Vec<Exported>,
}

/// On a prefill worker, turns `jobs` that name a decode worker (the peer
/// header) or a bootstrap room into prefill jobs (one token each) and
/// returns what to export once they finished. Bootstrap fields on a worker
/// that is not disaggregated, or a peer header on one that is not a
/// prefill worker, are refused.
pub(crate) fn prefill_jobs(
    st: &AppState,
    headers: &HeaderMap,
    jobs: &mut [Job],
) -> Result<Option<PrefillExport>, ApiError> {
    let peer = headers.get(PEER_HEADER);
    let rooms = jobs.iter().any(|j| j.bootstrap.is_some());
    let dest = match (&st.disagg, peer) {
        (_, None) if !rooms => return Ok(None),
        (None, None) => {
            return Err(ApiError::bad_request(
                "bootstrap_room: this worker is not disaggregated (start it with --disaggregation-mode prefill or decode)",
            ));
        }
        (None, Some(_)) => {
            return Err(ApiError::bad_request(format!(
                "{PEER_HEADER}: this worker is not a prefill worker (start it with --disaggregation-mode prefill)"
            )));
        }
        (Some(Disagg::Decode { .. }), None) => return Ok(None),
        (Some(Disagg::Decode { .. }), Some(_)) => {
            return Err(ApiError::bad_request(format!(
                "{PEER_HEADER}: this worker is not a prefill worker (start it with --disaggregation-mode prefill)"
            )));
        }
        (Some(Disagg::Prefill { .. }), Some(v)) => Destination::Peer(
            v.to_str()
                .ok()
                .filter(|p| {
                    p.rsplit_once(':')
                        .is_some_and(|(h, port)| !h.is_empty() && port.parse::<u16>().is_ok())
                })
                .ok_or_else(|| ApiError::bad_request(format!("{PEER_HEADER} must be HOST:PORT")))?
                .to_string(),
        ),
        (Some(Disagg::Prefill { rooms, .. }), None) => Destination::Rooms(rooms.clone()),
    };
    let mut prompts = Vec::with_capacity(jobs.len());
    for j in jobs.iter_mut() {
        if j.req.params.n > 1 {
            return Err(ApiError::bad_param(
                "n",
                "a disaggregated prefill runs one sample per prompt",
            ));
        }
        j.req.kind = RequestKind::PrefillForExport;
        prompts.push(Exported {
            ids: j.req.input_ids.clone(),
            namespace: j.req.namespace.clone(),
            lora: j.req.lora.clone(),
            room: j.bootstrap.as_ref().map(|b| b.room),
        });
    }
    Ok(Some(PrefillExport { dest, prompts }))
}

impl PrefillExport {
    /// The request was refused before it ran: each room gets the reason,
    /// so its decode worker stops waiting and computes the prompt itself.
    pub(crate) fn refuse(&self, why: &str) {
        if let Destination::Rooms(rooms) = &self.dest {
            for room in self.prompts.iter().filter_map(|p| p.room) {
                rooms.put(room, Err(format!("the prefill worker refused it: {why}")));
            }
        }
    }

    /// Exports every prompt's KV and hands it on, with the first token each
    /// prompt's run sampled (`first_tokens`, one per prompt; `None` for a run
    /// that ended without one) for the decode worker to start from; one
    /// report per prompt (an error text for a prompt whose transfer failed).
    pub(crate) async fn send(
        self,
        st: Arc<AppState>,
        first_tokens: Vec<Option<u32>>,
    ) -> Vec<Result<TransferReport, String>> {
        let Some(Disagg::Prefill { transfer, .. }) = st.disagg.clone() else {
            return Vec::new();
        };
        let engine = st.engine.clone();
        let work = tokio::task::spawn_blocking(move || {
            self.prompts
                .iter()
                .enumerate()
                .map(|(i, p)| {
                    let pages = engine
                        .export_kv(&p.ids, &p.namespace, p.lora.as_ref())
                        .map_err(|e| e.to_string());
                    match (&self.dest, p.room) {
                        (Destination::Rooms(rooms), Some(room)) => {
                            let report = match &pages {
                                Ok(k) => Ok(TransferReport {
                                    tokens: k.tokens.len(),
                                    bytes: k.bytes(),
                                    seconds: 0.0,
                                }),
                                Err(e) => Err(e.clone()),
                            };
                            let token = first_tokens.get(i).copied().flatten();
                            rooms.put(room, pages.map(|k| prefilled(k, &p.ids, token)));
                            report
                        }
                        (Destination::Rooms(_), None) => {
                            Err("a prompt without a bootstrap room".to_string())
                        }
                        (Destination::Peer(peer), _) => {
                            transfer.send(peer, &pages?).map_err(|e| e.to_string())
                        }
                    }
                })
                .collect::<Vec<_>>()
        });
        let reports = work
            .await
            .unwrap_or_else(|e| vec![Err(format!("KV transfer task failed: {e}"))]);
        for r in &reports {
            record(&st, r, "the decode worker computes the prompt itself");
        }
        reports
    }
}

/// A room's content: `pages` (a cached prefix of `prompt`) and the first
/// token the prefill sampled after `prompt`.
fn prefilled(pages: KvPages, prompt: &[u32], token: Option<u32>) -> Prefilled {
    let first = token.map(|token| FirstToken {
        prompt_tail: prompt
            .get(pages.tokens.len()..)
            .unwrap_or_default()
            .to_vec(),
        token,
    });
    Prefilled { pages, first }
}

fn record(st: &AppState, r: &Result<TransferReport, String>, fallback: &str) {
    match r {
        Ok(t) => {
            st.metrics.kv_transferred(t);
            tracing::debug!(
                "moved {} tokens of KV ({} bytes) in {:.3} s",
                t.tokens,
                t.bytes,
                t.seconds
            );
        }
        Err(e) => {
            st.metrics.kv_transfer_failed();
            tracing::warn!("KV transfer failed: {e}; {fallback}");
        }
    }
}

/// A room pull of one job.
struct Pull {
    job: usize,
    peer: String,
    room: u64,
    rank: Option<usize>,
    /// Whether the job may start from the prefill's first token (one
    /// sample, at least one new token, no log-probabilities: the token
    /// carries none).
    takes_first: bool,
}

/// On a decode worker, pulls the KV of every job that names a bootstrap
/// room with a port, and imports it, before the jobs are submitted; returns
/// per job the prefill's first token to start from, where the room has one
/// for exactly that job's prompt. A pull that fails is logged and counted;
/// the job then computes its prompt.
pub(crate) async fn pull_rooms(st: &Arc<AppState>, jobs: &[Job]) -> Vec<Option<u32>> {
    let mut first_tokens = vec![None; jobs.len()];
    let Some(Disagg::Decode { transfer }) = st.disagg.clone() else {
        return first_tokens;
    };
    let pulls: Vec<(Pull, Vec<u32>)> = jobs
        .iter()
        .enumerate()
        .filter_map(|(i, j)| {
            let b = j.bootstrap.as_ref()?;
            let pull = Pull {
                job: i,
                peer: format!("{}:{}", b.host, b.port?),
                room: b.room,
                rank: j.req.data_parallel_rank,
                takes_first: j.req.params.n <= 1
                    && !j.req.return_logprob
                    && j.req.params.max_new_tokens > 0,
            };
            Some((pull, j.req.input_ids.clone()))
        })
        .collect();
    if pulls.is_empty() {
        return first_tokens;
    }
    let engine = st.engine.clone();
    let work = tokio::task::spawn_blocking(move || {
        pulls
            .iter()
            .map(|(p, prompt)| {
                let start = std::time::Instant::now();
                let got = transfer.pull(&p.peer, p.room).map_err(|e| e.to_string())?;
                let first = got.first_token_for(prompt).filter(|_| p.takes_first);
                let bytes = got.pages.bytes();
                // A pinned request runs where its KV goes. A failed import
                // leaves the token usable: the prompt is computed here.
                let imported = engine.import_kv_on(got.pages, p.rank);
                Ok((
                    p.job,
                    first,
                    imported.map_err(|e| e.to_string()),
                    bytes,
                    start,
                ))
            })
            .collect::<Vec<Result<_, String>>>()
    });
    let results = work
        .await
        .unwrap_or_else(|e| vec![Err(format!("KV pull task failed: {e}"))]);
    for r in results {
        let report = r.and_then(|(job, first, imported, bytes, start)| {
            first_tokens[job] = first;
            Ok(TransferReport {
                tokens: imported?,
                bytes,
                seconds: start.elapsed().as_secs_f64(),
            })
        });
        record(st, &report, "this worker computes the prompt itself");
    }
    first_tokens
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn read(v: Value, count: usize) -> Result<Vec<Option<Bootstrap>>, ApiError> {
        let mut f = Fields::new(v, "body", "").unwrap();
        bootstrap_fields(&mut f, count)
    }

    #[test]
    fn bootstrap_fields_are_read_per_prompt() {
        let one = read(
            json!({"bootstrap_host": "10.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 42}),
            1,
        )
        .unwrap();
        assert_eq!(
            one,
            vec![Some(Bootstrap {
                host: "10.0.0.1".into(),
                port: Some(8998),
                room: 42
            })]
        );
        let batch = read(
            json!({"bootstrap_host": ["h", "h"], "bootstrap_port": [null, null], "bootstrap_room": [1, 2]}),
            2,
        )
        .unwrap();
        assert_eq!(batch[1].as_ref().map(|b| (b.port, b.room)), Some((None, 2)));
        // A chat request with n = 3 carries three rooms for its one prompt.
        let n3 = read(
            json!({"bootstrap_host": ["h", "h", "h"], "bootstrap_port": [1, 1, 1], "bootstrap_room": [7, 8, 9]}),
            1,
        )
        .unwrap();
        assert_eq!(n3[0].as_ref().map(|b| b.room), Some(7));
        assert_eq!(read(json!({}), 2).unwrap(), vec![None, None]);
    }

    #[test]
    fn bad_bootstrap_fields_name_the_field() {
        for (v, count, field) in [
            (json!({"bootstrap_room": 1}), 1, "bootstrap_host"),
            (
                json!({"bootstrap_host": "h", "bootstrap_room": -1}),
                1,
                "bootstrap_room",
            ),
            (
                json!({"bootstrap_host": "h", "bootstrap_port": 70000, "bootstrap_room": 1}),
                1,
                "bootstrap_port",
            ),
            (
                json!({"bootstrap_host": "h", "bootstrap_room": 1}),
                2,
                "bootstrap_room",
            ),
            (
                json!({"bootstrap_host": ["h"], "bootstrap_room": [1, 2, 3]}),
                2,
                "bootstrap_room",
            ),
        ] {
            let e = read(v.clone(), count).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(field), "{v}: {}", e.message);
        }
    }
}
