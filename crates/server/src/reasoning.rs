//! Reasoning parsers (SGLang's `--reasoning-parser`): re-exported from
//! [`arbor_chat_parsers::reasoning`], which owns them and their invariants.

pub use arbor_chat_parsers::reasoning::*;
