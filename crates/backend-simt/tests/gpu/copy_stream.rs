//! The copy stream on the emulated device, with a delay before each copy:
//! HiCache's load-back is exact although the copies land while the forward
//! runs, the forward's first wait is for the first layer's copies alone
//! (later layers still copying) and the last layer's comes after kernels of
//! the earlier layers ran, and every wait returns only once its fence has
//! passed. A backend that waited for every copy at the first use, or
//! for none, fails. The host pages are the backend's pinned memory, and
//! loads copy from them in place.

use arbor_backend_simt::{GpuBackend, Profile, SimtDriver};
use arbor_engine_core::BackendOptions;
use std::sync::Arc;
use std::time::Duration;

#[test]
fn each_layer_waits_only_for_its_own_copies() -> anyhow::Result<()> {
    let drv = match SimtDriver::open(Profile::Hopper) {
        Ok(d) => d.with_copy_delay(Duration::from_millis(25)),
        Err(e) => {
            if std::env::var("ARBOR_REQUIRE_CXX").is_ok_and(|v| v == "1") {
                panic!("ARBOR_REQUIRE_CXX=1 but the emulator is unavailable: {e}");
            }
            println!("skipped: {e}");
            return Ok(());
        }
    };
    let log = drv.copy_log();
    let gpu = Arc::new(GpuBackend::new(
        Box::new(drv),
        &BackendOptions::default(),
        arbor_backend_simt::ATTENTION,
    ));
    let model = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/tiny-llama");
    let run = crate::verify::shared_check::load_back_is_exact_in_the_step_that_loads(
        gpu.clone(),
        &model,
    )?;
    assert_eq!(run.memory, "pinned");
    let parts = run.batches;
    let stats = gpu.load_stats();
    assert_eq!(stats.batches as usize, parts, "{stats:?}");
    assert_eq!(stats.fallbacks, 0, "{stats:?}");
    // The held pinned host pages are copied from in place, not staged.
    assert!(
        stats.bytes > 0 && stats.in_place_bytes == stats.bytes,
        "{stats:?}"
    );
    let waits = log.waits();
    assert!(
        waits.iter().all(|w| w.passed >= w.fence),
        "a wait returned before its fence: {waits:?}"
    );
    assert_eq!(log.fences_passed() as usize, parts);
    // The first layer's K and V are the first two fences: the forward's
    // first wait is for one of them and returns while later layers copy;
    // the last layer's is waited for after kernels of the earlier layers ran.
    let (first, last) = (waits.first().copied(), waits.last().copied());
    assert!(
        first.is_some_and(|w| w.fence <= 2 && (w.passed as usize) < parts),
        "the forward's first wait {first:?} (of {parts} fences): {waits:?}"
    );
    assert!(
        first
            .zip(last)
            .is_some_and(|(f, l)| l.launches > f.launches),
        "no kernel ran between the first and the last wait: {waits:?}"
    );
    Ok(())
}

/// Strided host rows (a tensor-parallel rank's heads of each slot of a host
/// KV page, which holds every rank's heads) reach the device packed (the
/// device suite's `verify::strided_host_rows_are_written_packed`), and are
/// counted where they went: from the backend's pinned memory held until the
/// next sync copied in place, from other memory through staging.
#[test]
fn strided_rows_are_copied_in_place_from_pinned_memory() -> anyhow::Result<()> {
    use arbor_engine_core::{Backend, DType, HostData, HostRows};
    let drv = match SimtDriver::open(Profile::Hopper) {
        Ok(d) => d,
        Err(e) => {
            println!("skipped: {e}");
            return Ok(());
        }
    };
    let gpu = Arc::new(GpuBackend::new(
        Box::new(drv),
        &BackendOptions::default(),
        arbor_backend_simt::ATTENTION,
    ));
    let b: &dyn Backend = &*gpu;
    let crate::verify::StridedPage {
        bytes,
        slots,
        group,
        off,
        width,
        want,
    } = crate::verify::StridedPage::new();
    let mut pinned = b
        .host_memory()
        .expect("pinned memory")
        .alloc(bytes.len())
        .expect("alloc");
    pinned.bytes_mut().copy_from_slice(&bytes);
    for (source, held) in [
        (pinned.bytes(), HostData::UntilSync),
        (&bytes[..], HostData::Transient),
    ] {
        let before = gpu.load_stats();
        let dst = b.alloc(DType::F32, &[slots, width])?;
        let rows = HostRows::strided(&source[off * 4..], width * 4, group * 4, slots)?;
        b.write_async(&[(&dst, rows)], held)?;
        assert_eq!(b.download_f32(&dst)?, want, "{held:?}");
        let after = gpu.load_stats();
        let in_place = after.in_place_bytes - before.in_place_bytes;
        assert_eq!(after.bytes - before.bytes, (slots * width * 4) as u64);
        assert_eq!(
            in_place,
            if held == HostData::UntilSync {
                (slots * width * 4) as u64
            } else {
                0
            },
            "{held:?}: {after:?}"
        );
    }
    // Rows that do not fit their bytes are refused.
    assert!(HostRows::strided(&bytes[off * 4..], width * 4, group * 4, slots + 1).is_err());
    assert!(HostRows::strided(&bytes, group * 4 + 1, group * 4, 2).is_err());
    Ok(())
}
