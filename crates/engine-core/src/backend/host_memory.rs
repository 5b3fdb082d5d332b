//! Host memory a device copies from and to fastest (pinned, page-locked
//! memory on GPUs): what a backend offers the host KV tier
//! ([`crate::backend::Backend::host_memory`]). A region frees itself on drop.

/// Host memory that a device copies from and to fastest (pinned,
/// page-locked memory on GPUs), for the host tier's pages.
pub trait HostMemory: Send + Sync {
    /// A region of `bytes` zeroed bytes, or `None` when none can be had.
    fn alloc(&self, bytes: usize) -> Option<Box<dyn HostRegion>>;
    /// What the memory is, for summaries (`pinned`).
    fn kind(&self) -> &'static str;
}

/// Bytes from a [`HostMemory`], owned alone; freed on drop.
pub trait HostRegion: Send + Sync {
    /// The bytes.
    fn bytes(&self) -> &[u8];
    /// The bytes, to write.
    fn bytes_mut(&mut self) -> &mut [u8];
}

impl HostRegion for Vec<u8> {
    fn bytes(&self) -> &[u8] {
        self
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        self
    }
}
