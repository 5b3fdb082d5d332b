//! `[disaggregation]`: prefill/decode disaggregation (SGLang's
//! `--disaggregation-mode`), the flags, their checks and the start-up of
//! the KV transfer engine.
//!
//! A prefill worker sends the KV of each routed prompt to the decode worker
//! Arbor's router names, or keeps it in the request's bootstrap room (SGLang's
//! router) for the decode worker to pull from `--disaggregation-bootstrap-port`;
//! a decode worker listens for KV on `--disaggregation-transfer-port`, pulls
//! rooms, and imports the KV into its prefix cache.
//! Both need the radix cache. The transfer backend is `tcp`
//! (crates/kv-transfer); NIXL and Mooncake are not built in.

use crate::settings::Section;
use anyhow::{Result, bail};
use arbor_engine_core::engine::Engine;
use arbor_engine_core::engine::transfer::KvTransfer;
use arbor_kv_transfer::{RoomConfig, TcpReceiver, TcpRooms, TcpTransfer, wire::Limits};
use clap::Args;
use serde::{Deserialize, Serialize};
use std::sync::Arc;

/// `[disaggregation]` and the disaggregation flags (SGLang's names). One
/// declaration per setting ([`crate::settings`]).
#[derive(Args, Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct DisaggregationSection {
    /// null (a whole worker), prefill or decode.
    #[arg(long, help_heading = "Disaggregation")]
    pub disaggregation_mode: Option<String>,
    /// How KV moves between prefill and decode workers: tcp.
    #[arg(long, help_heading = "Disaggregation")]
    pub disaggregation_transfer_backend: Option<String>,
    /// Decode workers: the port the KV transfer engine listens on, on --host; 0 picks a free one (printed, and in /get_server_info).
    #[arg(long, help_heading = "Disaggregation")]
    pub disaggregation_transfer_port: Option<u16>,
    /// Prefill workers: the port of the bootstrap server decode workers pull bootstrap rooms from (give it to SGLang's router as `--prefill URL PORT`), on --host; 0 picks a free one (printed, and in /get_server_info; SGLang's default is 8998).
    #[arg(long, help_heading = "Disaggregation")]
    pub disaggregation_bootstrap_port: Option<u16>,
}

impl Section for DisaggregationSection {
    fn defaults() -> Self {
        Self {
            disaggregation_mode: Some("null".into()),
            disaggregation_transfer_backend: Some("tcp".into()),
            disaggregation_transfer_port: Some(0),
            disaggregation_bootstrap_port: Some(0),
        }
    }
}

/// A worker's role.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// Computes prompts and sends their KV.
    Prefill,
    /// Receives KV and generates.
    Decode,
}

/// Checked settings (`None`: a whole worker).
#[derive(Clone, Debug, PartialEq)]
pub struct DisaggregationSettings {
    /// The role.
    pub role: Role,
    /// Decode: the transfer port.
    pub port: u16,
    /// Prefill: the bootstrap port.
    pub bootstrap_port: u16,
}

impl DisaggregationSection {
    /// The checked settings; errors name the key.
    pub fn to_settings(&self, disable_radix_cache: bool) -> Result<Option<DisaggregationSettings>> {
        let backend = self
            .disaggregation_transfer_backend
            .as_deref()
            .unwrap_or("tcp");
        if backend != "tcp" {
            bail!(
                "[disaggregation] disaggregation_transfer_backend / --disaggregation-transfer-backend \
                 '{backend}': only tcp is built in (mooncake and nixl are not)"
            );
        }
        let role = match self.disaggregation_mode.as_deref().unwrap_or("null") {
            "null" => return Ok(None),
            "prefill" => Role::Prefill,
            "decode" => Role::Decode,
            other => bail!(
                "[disaggregation] disaggregation_mode / --disaggregation-mode '{other}': expected null, prefill or decode"
            ),
        };
        if disable_radix_cache {
            bail!(
                "[disaggregation] disaggregation_mode / --disaggregation-mode: prefill and decode workers \
                 share KV through the radix cache; drop --disable-radix-cache"
            );
        }
        Ok(Some(DisaggregationSettings {
            role,
            port: self.disaggregation_transfer_port.unwrap_or(0),
            bootstrap_port: self.disaggregation_bootstrap_port.unwrap_or(0),
        }))
    }
}

/// What a disaggregated worker runs beside its HTTP server.
pub enum Started {
    /// Prefill: the sender and the bootstrap rooms (which stop listening
    /// when dropped).
    Prefill {
        transfer: Arc<dyn KvTransfer>,
        rooms: Arc<TcpRooms>,
    },
    /// Decode: the listening receiver (stops when dropped) and the sender
    /// that pulls rooms.
    Decode {
        receiver: TcpReceiver,
        transfer: Arc<dyn KvTransfer>,
    },
}

impl Started {
    /// What the HTTP server needs of it.
    pub fn server_part(&self) -> arbor_server::disagg::Disagg {
        match self {
            Started::Prefill { transfer, rooms } => arbor_server::disagg::Disagg::Prefill {
                transfer: transfer.clone(),
                rooms: rooms.clone(),
            },
            Started::Decode { transfer, .. } => arbor_server::disagg::Disagg::Decode {
                transfer: transfer.clone(),
            },
        }
    }
}

/// Starts the transfer engine of `s` for `engine`; a decode receiver and a
/// prefill bootstrap server listen on `host`.
pub fn start(s: &DisaggregationSettings, engine: &Arc<Engine>, host: &str) -> Result<Started> {
    let transfer: Arc<dyn KvTransfer> = Arc::new(TcpTransfer::default());
    Ok(match s.role {
        Role::Prefill => {
            let rooms = TcpRooms::bind(
                &format!("{host}:{}", s.bootstrap_port),
                RoomConfig::default(),
            )
            .map_err(|e| {
                anyhow::anyhow!(
                    "--disaggregation-bootstrap-port {}: listening on {host}: {e}",
                    s.bootstrap_port
                )
            })?;
            Started::Prefill {
                transfer,
                rooms: Arc::new(rooms),
            }
        }
        Role::Decode => {
            let e = engine.clone();
            let sink = Arc::new(move |p| e.import_kv(p).map_err(|e| e.to_string()));
            let rx = TcpReceiver::bind(&format!("{host}:{}", s.port), sink, Limits::default())
                .map_err(|e| {
                    anyhow::anyhow!(
                        "--disaggregation-transfer-port {}: listening on {host}: {e}",
                        s.port
                    )
                })?;
            Started::Decode {
                receiver: rx,
                transfer,
            }
        }
    })
}
