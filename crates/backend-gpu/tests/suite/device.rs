//! Creating the backend: on a machine without a usable device (no driver, no
//! GPU, no BLAS library or runtime compiler) it is an error that starts with
//! [`crate::vendor::NO_DEVICE`] ("no CUDA device", "no ROCm device"), never a
//! panic, through the type and through the registry; with a device it opens
//! and describes itself.
use crate::vendor::{NAME, NO_DEVICE, open, probe};
use arbor_engine_core::{Backend, BackendOptions, CoreError, Registry};

#[test]
fn creation_errors_without_a_device_and_works_with_one() {
    let made = open(&BackendOptions::default());
    let registry = Registry::builtin().unwrap();
    assert!(registry.backends.names().contains(&NAME.to_string()));
    let factory = registry.backends.get(NAME).unwrap();
    match probe() {
        Err(why) => {
            println!("no device here ({why}): checking the error path");
            match made {
                Err(CoreError::Device(msg)) => {
                    assert!(msg.starts_with(&format!("{NO_DEVICE}: ")), "{msg}")
                }
                Err(other) => panic!("expected a device error, got {other}"),
                Ok(_) => panic!("the backend opened although probe failed"),
            }
            let err = factory(&BackendOptions::default()).err().unwrap();
            assert!(err.to_string().contains(NO_DEVICE), "{err}");
        }
        Ok(_) => {
            let b = made.unwrap();
            let info = b.info();
            println!(
                "{} ({} SMs, {:?} bytes), kernels for {}, graph buckets {:?}",
                info.name,
                info.parallelism.unwrap_or(0),
                info.total_memory,
                b.kernel_target(),
                b.graph_buckets()
            );
            assert_eq!(info.backend, NAME);
            assert!(b.capabilities().asynchronous);
            assert!(factory(&BackendOptions::default()).is_ok());
            let off = open(&BackendOptions {
                disable_cuda_graph: true,
                ..Default::default()
            })
            .unwrap();
            assert!(off.graph_buckets().is_empty());
            let capped = open(&BackendOptions {
                cuda_graph_max_bs: Some(20),
                ..Default::default()
            })
            .unwrap();
            assert_eq!(capped.graph_buckets(), vec![1, 2, 4, 8, 16, 20]);
        }
    }
}
