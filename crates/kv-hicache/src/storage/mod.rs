//! Storage backends of the HiCache's third tier.
