//! Logit edits on the device (the check shared with the CPU and wgpu
//! suites): `edit_logits` gives the host's bits, and an executor sampling
//! with penalties, logit bias, `min_new_tokens` and grammar masks keeps
//! every row on the device and picks exactly the host path's greedy tokens.

#[path = "../../../engine-core/tests/support/edits.rs"]
mod shared_check;

#[test]
fn logit_edits_match_the_host_path_on_the_device() -> anyhow::Result<()> {
    let Some(gpu) = crate::common::gpu() else {
        return Ok(());
    };
    let model = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/tiny-llama");
    // The device's draws follow the host's distribution, not its tokens.
    shared_check::edited_sampling_matches_host(gpu, &model, false)
}
