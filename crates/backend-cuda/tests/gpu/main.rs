//! The GPU tests of the CUDA backend, as one test binary (one device context,
//! one kernel build). Each test prints "skipped: ... no CUDA device ..." and
//! passes on a machine without a device, unless `ARBOR_REQUIRE_CUDA=1`.
//! `scripts/gpu-check.sh` runs them on a GPU.
#![allow(clippy::unwrap_used)]

mod attention;
mod common;
mod device;
mod graphs;
mod logit_edits;
mod ops;
mod parity;
mod sampling;
mod verify;
