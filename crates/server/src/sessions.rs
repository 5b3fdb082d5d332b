//! SGLang's session control: `POST /open_session`, `POST /close_session`,
//! and `session_params` on `/generate`, so an agent continues, branches or
//! rewinds a conversation by naming an earlier request instead of resending
//! its tokens.
//!
//! A session is a tree of finished requests (by request id), each holding
//! its whole token sequence (prompt then output). A request with
//! `session_params: {id, rid, offset, replace, drop_previous_output}` runs
//! on its parent's sequence (`rid`'s prompt and output; only its prompt with
//! `drop_previous_output`; cut to its first `offset` tokens when `offset` is
//! set) followed by its own input (a leading BOS dropped), as SGLang's
//! session controller composes it. `replace` drops the parent's other
//! branches first (with no `rid`, the whole tree). The prompt's reuse comes
//! from the prefix cache. A request joins the tree when it finished; naming
//! an unknown session or request is a 400 naming the field.
//!
//! A session's finished requests are held in the prefix cache under the
//! session's id (`GenerateRequest::hold`): the engine keeps them against
//! eviction within its hold budget (`--session-hold-ratio`), so the next
//! turn finds its prefix cached even after other traffic.
//! `/open_session` takes Arbor's `timeout` (seconds) besides SGLang's
//! fields: a session idle that long is closed, as if by `/close_session`.
//!
//! Invariants: at most [`MAX_SESSIONS`] sessions are open (more are
//! refused); closing a session (or its expiry) aborts its requests still
//! running, drops its tree and releases its holds, so a closed session
//! leaves no KV in use. Expired sessions are closed on every session call
//! and by the server's sweep ([`sweep`]).

use crate::error::{ApiError, json_reply};
use crate::fields::{Fields, request_fields};
use crate::state::AppState;
use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;
use serde_json::{Value, json};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Most sessions open at once.
pub const MAX_SESSIONS: usize = 4096;

/// One request of a session.
#[derive(Debug)]
struct Node {
    prompt: Vec<u32>,
    output: Vec<u32>,
    parent: Option<String>,
}

/// One session's requests.
#[derive(Debug)]
struct Session {
    nodes: HashMap<String, Node>,
    /// Requests submitted and not finished yet (aborted on close).
    running: Vec<String>,
    /// Closed after this long without a request (`None`: open until closed).
    timeout: Option<Duration>,
    /// When a request of the session last started or finished.
    last_used: Instant,
}

impl Session {
    fn new(timeout: Option<Duration>) -> Self {
        Self {
            nodes: HashMap::new(),
            running: Vec::new(),
            timeout,
            last_used: Instant::now(),
        }
    }

    /// Idle past its timeout at `now` (never while a request runs).
    fn expired(&self, now: Instant) -> bool {
        self.running.is_empty()
            && self
                .timeout
                .is_some_and(|t| now.saturating_duration_since(self.last_used) >= t)
    }

    /// Removes `rid`'s descendants (not `rid`).
    fn drop_children(&mut self, rid: &str) {
        let kids: Vec<String> = self
            .nodes
            .iter()
            .filter(|(_, n)| n.parent.as_deref() == Some(rid))
            .map(|(k, _)| k.clone())
            .collect();
        for k in kids {
            self.drop_children(&k);
            self.nodes.remove(&k);
        }
    }
}

/// The open sessions.
#[derive(Debug, Default)]
pub(crate) struct Sessions {
    open: Mutex<HashMap<String, Session>>,
}

/// A request's `session_params`, parsed.
#[derive(Clone, Debug)]
pub(crate) struct SessionParams {
    pub id: String,
    pub rid: Option<String>,
    pub offset: Option<usize>,
    pub replace: bool,
    pub drop_previous_output: bool,
}

impl SessionParams {
    /// Parses `session_params` (an object; `id` required).
    pub fn parse(v: Value) -> Result<Self, ApiError> {
        let mut f = Fields::new(v, "'session_params'", "session_params.")?;
        let id = f.string("id")?.ok_or_else(|| {
            ApiError::bad_param("session_params.id", "'session_params.id' is required")
        })?;
        let rid = f.string("rid")?;
        let offset = f
            .int("offset", -1, i64::MAX)?
            .filter(|&o| o > 0)
            .map(|o| o as usize);
        let replace = f.bool("replace")?.unwrap_or(false);
        let drop_previous_output = f.bool("drop_previous_output")?.unwrap_or(false);
        f.finish()?;
        Ok(Self {
            id,
            rid,
            offset,
            replace,
            drop_previous_output,
        })
    }
}

/// Where a finished session request goes (its composed prompt).
#[derive(Clone, Debug)]
pub(crate) struct Pending {
    pub session: String,
    pub parent: Option<String>,
    pub prompt: Vec<u32>,
}

impl Sessions {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Session>> {
        self.open.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Removes the sessions idle past their timeout; the caller closes them.
    fn take_expired(&self) -> Vec<(String, Session)> {
        let now = Instant::now();
        let mut open = self.lock();
        let ids: Vec<String> = open
            .iter()
            .filter(|(_, s)| s.expired(now))
            .map(|(k, _)| k.clone())
            .collect();
        ids.into_iter()
            .filter_map(|k| open.remove(&k).map(|s| (k, s)))
            .collect()
    }

    /// Closes the expired sessions: their running requests are aborted (none
    /// run: a running request keeps its session alive) and their holds released.
    pub fn expire(&self, engine: &arbor_engine_core::engine::Engine) {
        for (id, s) in self.take_expired() {
            tracing::info!("session '{id}' expired");
            close(engine, &id, &s);
        }
    }

    /// The prompt of a request in a session: its parent's sequence (see the
    /// module doc) and `input` (a leading `bos` dropped after a parent).
    pub fn compose(
        &self,
        p: &SessionParams,
        mut input: Vec<u32>,
        bos: Option<u32>,
    ) -> Result<Pending, ApiError> {
        let mut open = self.lock();
        let s = open.get_mut(&p.id).ok_or_else(|| {
            ApiError::bad_param("session_params.id", format!("no open session '{}'", p.id))
        })?;
        s.last_used = Instant::now();
        let Some(rid) = &p.rid else {
            if p.replace {
                s.nodes.clear();
            }
            return Ok(Pending {
                session: p.id.clone(),
                parent: None,
                prompt: input,
            });
        };
        let node = s.nodes.get(rid).ok_or_else(|| {
            ApiError::bad_param(
                "session_params.rid",
                format!("session '{}' holds no finished request '{rid}'", p.id),
            )
        })?;
        let mut prompt = node.prompt.clone();
        if !p.drop_previous_output {
            prompt.extend_from_slice(&node.output);
        }
        if let Some(o) = p.offset {
            if o > prompt.len() {
                return Err(ApiError::bad_param(
                    "session_params.offset",
                    format!(
                        "'session_params.offset' is {o} but request '{rid}' holds {} tokens",
                        prompt.len()
                    ),
                ));
            }
            prompt.truncate(o);
        }
        if bos.is_some() && input.first().copied() == bos {
            input.remove(0);
        }
        prompt.extend(input);
        if p.replace {
            s.drop_children(rid);
        }
        Ok(Pending {
            session: p.id.clone(),
            parent: Some(rid.clone()),
            prompt,
        })
    }

    /// Notes a submitted request (aborted if its session closes).
    pub fn started(&self, session: &str, rid: &str) {
        if let Some(s) = self.lock().get_mut(session) {
            s.running.push(rid.to_string());
            s.last_used = Instant::now();
        }
    }

    /// Adds a finished request to its session's tree; an aborted one
    /// (`output` `None`) only stops running. Nothing when the session closed
    /// meanwhile.
    pub fn finished(&self, pending: &Pending, rid: &str, output: Option<&[u32]>) {
        let mut open = self.lock();
        let Some(s) = open.get_mut(&pending.session) else {
            return;
        };
        s.running.retain(|r| r != rid);
        s.last_used = Instant::now();
        let Some(output) = output else {
            return;
        };
        s.nodes.insert(
            rid.to_string(),
            Node {
                prompt: pending.prompt.clone(),
                output: output.to_vec(),
                parent: pending.parent.clone(),
            },
        );
    }
}

/// Ends a session removed from the open ones: aborts its running requests
/// and releases its holds.
fn close(engine: &arbor_engine_core::engine::Engine, id: &str, s: &Session) {
    for rid in &s.running {
        engine.abort(rid);
    }
    engine.release_hold(id);
}

/// Closes expired sessions every second while the server runs.
pub(crate) async fn sweep(st: Arc<AppState>) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tick.tick().await;
        st.sessions.expire(&st.engine);
    }
}

/// Handles `POST /open_session {"capacity_of_str_len", "session_id"?,
/// "timeout"?}`: answers the session id (a JSON string, as SGLang does).
/// `timeout` (Arbor's): seconds of idleness after which the session closes.
pub(crate) async fn open_session(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let inner = async {
        let mut f = request_fields(&st, &headers, body).await?;
        f.int("capacity_of_str_len", 1, i64::MAX)?.ok_or_else(|| {
            ApiError::bad_param("capacity_of_str_len", "'capacity_of_str_len' is required")
        })?;
        let id = f.string("session_id")?.unwrap_or_else(|| st.new_id());
        let timeout = match f.f32("timeout")? {
            Some(t) if t.is_finite() && t > 0.0 => Some(Duration::from_secs_f32(t)),
            Some(t) => {
                return Err(ApiError::bad_param(
                    "timeout",
                    format!("'timeout' must be a positive number of seconds, got {t}"),
                ));
            }
            None => None,
        };
        f.finish()?;
        st.sessions.expire(&st.engine);
        let mut open = st.sessions.lock();
        if open.contains_key(&id) {
            return Err(ApiError::bad_param(
                "session_id",
                format!("session '{id}' is open already"),
            ));
        }
        if open.len() >= MAX_SESSIONS {
            return Err(ApiError::unavailable(format!(
                "{MAX_SESSIONS} sessions are open: close one first"
            )));
        }
        open.insert(id.clone(), Session::new(timeout));
        Ok::<_, ApiError>(id)
    };
    json_reply(inner.await.map(Value::String))
}

/// Handles `POST /close_session {"session_id"}`: aborts the session's
/// running requests and forgets its tree.
pub(crate) async fn close_session(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let inner = async {
        let mut f = request_fields(&st, &headers, body).await?;
        let id = f
            .string("session_id")?
            .ok_or_else(|| ApiError::bad_param("session_id", "'session_id' is required"))?;
        f.finish()?;
        let closed =
            st.sessions.lock().remove(&id).ok_or_else(|| {
                ApiError::bad_param("session_id", format!("no open session '{id}'"))
            })?;
        close(&st.engine, &id, &closed);
        Ok::<_, ApiError>(json!({"success": true}))
    };
    json_reply(inner.await)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(rid: Option<&str>) -> SessionParams {
        SessionParams {
            id: "s".into(),
            rid: rid.map(str::to_string),
            offset: None,
            replace: false,
            drop_previous_output: false,
        }
    }

    #[test]
    fn compose_continue_rewind_and_replace() {
        let s = Sessions::default();
        s.lock().insert("s".into(), Session::new(None));
        let a = s.compose(&params(None), vec![1, 2, 3], Some(1)).unwrap();
        assert_eq!(a.prompt, vec![1, 2, 3]);
        s.finished(&a, "a", Some(&[7, 8]));
        let b = s.compose(&params(Some("a")), vec![1, 9], Some(1)).unwrap();
        assert_eq!(b.prompt, vec![1, 2, 3, 7, 8, 9]);
        s.finished(&b, "b", Some(&[5]));
        let mut rewind = params(Some("a"));
        rewind.offset = Some(2);
        assert_eq!(
            s.compose(&rewind, vec![4], None).unwrap().prompt,
            vec![1, 2, 4]
        );
        let mut drop = params(Some("a"));
        drop.drop_previous_output = true;
        assert_eq!(
            s.compose(&drop, vec![4], None).unwrap().prompt,
            vec![1, 2, 3, 4]
        );
        let mut too_far = params(Some("a"));
        too_far.offset = Some(6);
        assert_eq!(
            s.compose(&too_far, vec![4], None)
                .unwrap_err()
                .param
                .as_deref(),
            Some("session_params.offset")
        );
        let mut replace = params(Some("a"));
        replace.replace = true;
        s.compose(&replace, vec![4], None).unwrap();
        assert!(
            s.compose(&params(Some("b")), vec![4], None).is_err(),
            "b was replaced"
        );
        assert!(s.compose(&params(Some("a")), vec![4], None).is_ok());
        let mut other = params(None);
        other.id = "t".into();
        assert_eq!(
            s.compose(&other, vec![4], None)
                .unwrap_err()
                .param
                .as_deref(),
            Some("session_params.id")
        );
    }
}
