//! Chain and tree verification of draft tokens on the device (the checks
//! shared with the CPU and wgpu suites): one verify step accepts exactly what
//! plain one-token decode steps produce, through a non-first tree branch too,
//! and a rejected draft leaves no trace;
//! HiCache's page copies between device and host move KV exactly, also in
//! the step whose forward reads the pages it loads; and the pinned host
//! memory of the host tier comes in zeroed, disjoint regions.

#[path = "../../../engine-core/tests/support/verify.rs"]
pub mod shared_check;

#[test]
fn chain_verification_is_exact_on_the_device() -> anyhow::Result<()> {
    let Some(gpu) = crate::common::gpu() else {
        return Ok(());
    };
    let model = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/tiny-llama");
    shared_check::chain_verify_matches_decode(gpu, &model)
}

#[test]
fn tree_verification_is_exact_on_the_device() -> anyhow::Result<()> {
    let Some(gpu) = crate::common::gpu() else {
        return Ok(());
    };
    let model = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/tiny-llama");
    shared_check::tree_verify_matches_decode(gpu, &model)
}

#[test]
fn tier_copies_are_exact_on_the_device() -> anyhow::Result<()> {
    let Some(gpu) = crate::common::gpu() else {
        return Ok(());
    };
    let model = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/tiny-llama");
    shared_check::tier_copies_move_kv_exactly(gpu, &model)
}

#[test]
fn load_back_is_exact_on_the_device() -> anyhow::Result<()> {
    let Some(gpu) = crate::common::gpu() else {
        return Ok(());
    };
    let model = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/tiny-llama");
    let run = shared_check::load_back_is_exact_in_the_step_that_loads(gpu, &model)?;
    // wgpu has no pinned memory of its own; CUDA, ROCm and the emulator do.
    assert_eq!(
        run.memory,
        if crate::vendor::NAME == "wgpu" {
            "heap"
        } else {
            "pinned"
        }
    );
    Ok(())
}

#[path = "../../../lora/tests/support/device.rs"]
mod lora_check;

#[test]
fn lora_segments_match_peft_on_the_device() -> anyhow::Result<()> {
    let Some(gpu) = crate::common::gpu() else {
        return Ok(());
    };
    lora_check::lora_batch_matches_peft(gpu, 1e-3)
}

/// The host tier's pinned memory: zeroed regions that never overlap, from
/// chunks of 64 MiB (one of its own for a larger region).
#[test]
fn pinned_host_regions_are_zeroed_and_disjoint() {
    let Some(gpu) = crate::common::gpu() else {
        return;
    };
    use arbor_engine_core::Backend;
    let Some(mem) = gpu.host_memory() else {
        // wgpu has no pinned memory of its own; CUDA, ROCm and the emulator do.
        assert_eq!(crate::vendor::NAME, "wgpu");
        return;
    };
    assert_eq!(mem.kind(), "pinned");
    let sizes = [100, 4096, 1, 70 << 20, 333];
    let mut regions: Vec<_> = sizes
        .iter()
        .map(|&n| mem.alloc(n).expect("pinned memory"))
        .collect();
    for (i, r) in regions.iter_mut().enumerate() {
        assert_eq!(r.bytes().len(), sizes[i]);
        assert!(r.bytes().iter().all(|&b| b == 0), "region {i} not zeroed");
        r.bytes_mut().fill(i as u8 + 1);
    }
    for (i, r) in regions.iter().enumerate() {
        assert!(
            r.bytes().iter().all(|&b| b == i as u8 + 1),
            "region {i} was overwritten by another"
        );
    }
    let mut spans: Vec<(usize, usize)> = regions
        .iter()
        .map(|r| (r.bytes().as_ptr() as usize, r.bytes().len()))
        .collect();
    spans.sort();
    assert!(spans.windows(2).all(|w| w[0].0 + w[0].1 <= w[1].0));
}
