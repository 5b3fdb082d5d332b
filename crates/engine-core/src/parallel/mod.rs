//! The `parallel` room: executors that split one model over several ranks.
//! [`tp`] runs tensor- and expert-parallel ranks as one executor;
//! [`dp_attention`] runs data-parallel attention groups. The communicators
//! they use are `crate::comm` (shared with the models, which reduce through
//! them).

pub mod dp_attention;
pub mod tp;
