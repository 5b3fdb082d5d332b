//! Arbor's LoRA adapters (SGLang's `--enable-lora`): PEFT folders checked
//! against the served model and put on its device ([`load_adapter`]), and
//! the [`LoraRegistry`] that requests name them in.
//!
//! The adapters' application to a batch (segments of rows, one shrink and
//! one expand product per adapter and module) is engine-core's
//! [`arbor_engine_core::lora`]; the scheduler caps the distinct adapters of
//! a step (`max_loras_per_batch`), and each adapter's digest is part of the
//! prefix-cache namespace of its requests.

pub mod error;
pub mod load;
pub mod peft;
pub mod registry;

pub use error::{LoraError, Result};
pub use load::{LoraLimits, load_adapter, load_adapter_on, target_shape};
pub use peft::{PeftConfig, TargetModules};
pub use registry::{LoadedLora, LoraRegistry};
