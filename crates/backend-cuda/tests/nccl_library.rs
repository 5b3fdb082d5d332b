//! NCCL without a GPU: the library found by `ARBOR_NCCL_LIB` (CI points it
//! at PyPI's `nvidia-nccl-cu12`) loads, every function the communicator
//! calls resolves, it reports its version and makes a unique id, and a group
//! it cannot form (no CUDA device here, or the same device twice) is an
//! error that names the cause, never a panic. Without the library the tests
//! print why and pass, unless `ARBOR_REQUIRE_NCCL=1`. The collectives
//! themselves run in the GPU suite (`tests/gpu/nccl.rs`).

#![allow(clippy::unwrap_used)]

use arbor_backend_cuda::nccl::{self, MIN_VERSION, NcclGroup};
use arbor_engine_core::BackendOptions;

fn nccl_or_skip() -> Option<&'static nccl::Nccl> {
    match nccl::library() {
        Ok(n) => Some(n),
        Err(e) => {
            assert!(
                !std::env::var("ARBOR_REQUIRE_NCCL").is_ok_and(|v| v == "1"),
                "ARBOR_REQUIRE_NCCL=1 but NCCL did not load: {e}"
            );
            println!("skipped: {e}");
            None
        }
    }
}

#[test]
fn the_library_loads_with_its_version_and_makes_unique_ids() {
    let Some(n) = nccl_or_skip() else { return };
    let (major, minor, patch) = n.version_parts();
    println!("NCCL {major}.{minor}.{patch} from {}", n.path);
    assert!(n.version >= MIN_VERSION, "{}", n.version);
    assert_eq!(major, 2);
    let (a, b) = (n.unique_id().unwrap(), n.unique_id().unwrap());
    assert!(a.iter().any(|&x| x != 0), "an all-zero unique id");
    assert_ne!(a, b, "two unique ids are the same");
    // NCCL's descriptions of its own codes come through.
    let e = n.check(1, "a call").unwrap_err().to_string();
    let text = e.split("a call: NCCL error 1: ").nth(1).unwrap_or_default();
    assert!(!text.is_empty(), "{e}");
    assert!(n.check(0, "a call").is_ok());
}

#[test]
fn a_group_that_cannot_form_is_an_error_not_a_panic() {
    let Some(_) = nccl_or_skip() else { return };
    let e = NcclGroup::new(&[0, 0]).err().unwrap().to_string();
    assert!(
        e.contains("one distinct device per rank") && e.contains("[0, 0]"),
        "{e}"
    );
    assert!(NcclGroup::new(&[]).is_err());
    if arbor_backend_cuda::probe().is_ok() {
        println!("skipped the no-device half: this machine has a CUDA device");
        return;
    }
    // NCCL itself refuses: no device to put the ranks on.
    let e = NcclGroup::new(&[0, 1]).err().unwrap().to_string();
    assert!(
        e.contains("ncclCommInitAll over devices [0, 1]: NCCL error"),
        "{e}"
    );
    // The registry's device group opens the backends first.
    let opts: Vec<BackendOptions> = (0..2)
        .map(|i| BackendOptions {
            device_index: i,
            ..Default::default()
        })
        .collect();
    let e = nccl::open_group(&opts).err().unwrap().to_string();
    assert!(e.contains("no CUDA device"), "{e}");
}
