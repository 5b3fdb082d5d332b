//! Chain and tree verification of draft tokens on the wgpu device (the checks
//! shared with the CPU and CUDA suites): one verify step accepts exactly what
//! plain one-token decode steps produce, through a non-first tree branch too,
//! and a rejected draft leaves no trace; and
//! HiCache's page copies between device and host move KV exactly.
#![allow(clippy::unwrap_used)]

mod common;

#[path = "../../engine-core/tests/support/verify.rs"]
mod verify;

#[test]
fn chain_verification_is_exact_on_wgpu() -> anyhow::Result<()> {
    let Some(gpu) = common::gpu() else {
        return Ok(());
    };
    let model = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/tiny-llama");
    verify::chain_verify_matches_decode(gpu, &model)
}

#[test]
fn tree_verification_is_exact_on_wgpu() -> anyhow::Result<()> {
    let Some(gpu) = common::gpu() else {
        return Ok(());
    };
    let model = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/tiny-llama");
    verify::tree_verify_matches_decode(gpu, &model)
}

#[test]
fn tier_copies_are_exact_on_wgpu() -> anyhow::Result<()> {
    let Some(gpu) = common::gpu() else {
        return Ok(());
    };
    let model = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/tiny-llama");
    verify::tier_copies_move_kv_exactly(gpu, &model)
}

#[path = "../../lora/tests/support/device.rs"]
mod lora;

#[test]
fn lora_segments_match_peft_on_wgpu() -> anyhow::Result<()> {
    let Some(gpu) = common::gpu() else {
        return Ok(());
    };
    lora::lora_batch_matches_peft(gpu, 1e-3)
}
