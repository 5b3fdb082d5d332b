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

/// Strided host rows (one tensor-parallel rank's heads of each slot of a
/// host KV page) written by `write_async` reach the device packed: from
/// the device's pinned memory held until the next sync (copied in place,
/// by one 2-D copy on CUDA and ROCm), and from plain memory.
#[test]
fn strided_host_rows_are_written_packed() -> anyhow::Result<()> {
    let Some(gpu) = crate::common::gpu() else {
        return Ok(());
    };
    use arbor_engine_core::{Backend, DType, HostData, HostRows};
    let b: &dyn Backend = &*gpu;
    let StridedPage {
        bytes,
        slots,
        group,
        off,
        width,
        want,
    } = StridedPage::new();
    let pinned = b.host_memory().and_then(|m| m.alloc(bytes.len()));
    let mut sources: Vec<(Box<dyn arbor_engine_core::HostRegion>, HostData)> =
        vec![(Box::new(bytes.clone()), HostData::Transient)];
    if let Some(mut region) = pinned {
        region.bytes_mut().copy_from_slice(&bytes);
        sources.push((region, HostData::UntilSync));
    }
    for (source, held) in &sources {
        let dst = b.alloc(DType::F32, &[slots, width])?;
        let rows = HostRows::strided(&source.bytes()[off * 4..], width * 4, group * 4, slots)?;
        b.write_async(&[(&dst, rows)], *held)?;
        assert_eq!(b.download_f32(&dst)?, want, "{held:?}");
    }
    Ok(())
}

/// A host KV page part of 16 slots, each holding three ranks' rows of 8, 12
/// and 4 floats, and rank 1's rows packed (what the device must receive).
pub struct StridedPage {
    pub bytes: Vec<u8>,
    pub slots: usize,
    /// Floats per slot (all ranks).
    pub group: usize,
    /// Rank 1's first float in a slot, and its floats per slot.
    pub off: usize,
    pub width: usize,
    pub want: Vec<f32>,
}

impl StridedPage {
    pub fn new() -> Self {
        let (slots, group, off, width) = (16, 24, 8, 12);
        let values: Vec<f32> = (0..slots * group).map(|i| i as f32 * 0.5 - 7.0).collect();
        Self {
            bytes: values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            want: (0..slots)
                .flat_map(|s| values[s * group + off..s * group + off + width].to_vec())
                .collect(),
            slots,
            group,
            off,
            width,
        }
    }
}
