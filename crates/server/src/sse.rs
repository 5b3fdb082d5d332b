//! Server-sent events: streaming a [`Run`] as `data: {...}` frames ending
//! with `data: [DONE]` (the Responses API frames its events with their
//! `event:` name and sends no `[DONE]`: [`StreamFormat::frame`],
//! [`StreamFormat::done`]).
//!
//! A spawned task drives the run and formats each event with a
//! [`StreamFormat`]; the response body reads the frames from a bounded
//! channel. When the client goes away the body (and the channel's receiver)
//! is dropped; the task sees the channel close, returns, and drops the run,
//! which aborts the unfinished samples.

use crate::run::{Event, Run};
use axum::body::{Body, Bytes};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::Response;
use std::convert::Infallible;

/// How one API turns a run's events into SSE payloads.
pub(crate) trait StreamFormat: Send + 'static {
    /// Payloads sent before the first event.
    fn start(&mut self, _run: &Run) -> Vec<String> {
        Vec::new()
    }
    /// Payloads for one event (possibly none).
    fn event(&mut self, run: &Run, ev: &Event) -> Vec<String>;
    /// Payloads after the last event (before `[DONE]`).
    fn end(&mut self, _run: &Run) -> Vec<String> {
        Vec::new()
    }
    /// One payload as an SSE frame.
    fn frame(&self, payload: &str) -> Bytes {
        Bytes::from(format!("data: {payload}\n\n"))
    }
    /// The payload that ends the stream, if any.
    fn done(&self) -> Option<&'static str> {
        Some("[DONE]")
    }
}

/// Streams `run` formatted by `fmt` as an SSE response.
pub(crate) fn stream_response(mut run: Run, mut fmt: impl StreamFormat) -> Response {
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(64);
    tokio::spawn(async move {
        for p in fmt.start(&run) {
            if tx.send(fmt.frame(&p)).await.is_err() {
                return;
            }
        }
        loop {
            let ev = tokio::select! {
                ev = run.next() => ev,
                _ = tx.closed() => return,
            };
            let Some(ev) = ev else { break };
            for p in fmt.event(&run, &ev) {
                if tx.send(fmt.frame(&p)).await.is_err() {
                    return;
                }
            }
        }
        for p in fmt.end(&run) {
            if tx.send(fmt.frame(&p)).await.is_err() {
                return;
            }
        }
        if let Some(done) = fmt.done() {
            let _ = tx.send(fmt.frame(done)).await;
        }
    });
    let body = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|b| (Ok::<_, Infallible>(b), rx))
    });
    let mut resp = Response::new(Body::from_stream(body));
    *resp.status_mut() = StatusCode::OK;
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h.insert("x-accel-buffering", HeaderValue::from_static("no"));
    resp
}
