//! Device tensors as handles.
//!
//! A [`Tensor`] names a region of a device buffer; it never exposes the memory
//! itself, because on a GPU that memory is not addressable from the host. Only
//! the backend that allocated a buffer can read or write it, through the
//! [`Backend`](crate::Backend) operations or explicit host↔device copies.
//!
//! Invariants: a buffer is freed exactly once, when the last tensor that views
//! it is dropped (the owner's `release` is called from `Drop`). Tensors are
//! contiguous row-major views: `offset` is in bytes from the buffer start and
//! `shape.iter().product()` elements of `dtype` follow it inside the buffer.

use crate::dtype::DType;
use crate::error::{CoreError, Result};
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

/// Identifies a buffer: the allocating device instance and a slot within it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BufferId {
    /// Unique per backend instance (see [`next_device_tag`]).
    pub device: u32,
    /// Backend-defined slot.
    pub slot: u64,
}

static DEVICE_TAGS: AtomicU32 = AtomicU32::new(1);

/// A fresh tag for a new backend instance, so buffers of two devices never mix.
pub fn next_device_tag() -> u32 {
    DEVICE_TAGS.fetch_add(1, Ordering::Relaxed)
}

/// Implemented by backends: frees a buffer when its last handle drops.
pub trait BufferOwner: Send + Sync {
    /// Releases the buffer with this id. Called exactly once per buffer.
    fn release(&self, id: BufferId);
}

/// An allocation on a device. Frees itself on drop.
pub struct DeviceBuffer {
    id: BufferId,
    bytes: usize,
    owner: Arc<dyn BufferOwner>,
}

impl DeviceBuffer {
    /// Wraps a buffer the owner has allocated. Only backends call this.
    pub fn new(id: BufferId, bytes: usize, owner: Arc<dyn BufferOwner>) -> Self {
        Self { id, bytes, owner }
    }
    /// The buffer's id.
    pub fn id(&self) -> BufferId {
        self.id
    }
    /// Size in bytes.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        self.owner.release(self.id);
    }
}

impl fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DeviceBuffer({:?}, {} bytes)", self.id, self.bytes)
    }
}

/// A typed, shaped, contiguous view of a device buffer.
#[derive(Clone)]
pub struct Tensor {
    buffer: Arc<DeviceBuffer>,
    dtype: DType,
    shape: Vec<usize>,
    offset: usize,
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Tensor({} {:?} @{:?}+{})",
            self.dtype,
            self.shape,
            self.buffer.id(),
            self.offset
        )
    }
}

impl Tensor {
    /// A view of the whole buffer. Errors if the shape does not fit.
    pub fn new(buffer: Arc<DeviceBuffer>, dtype: DType, shape: &[usize]) -> Result<Self> {
        let t = Tensor {
            buffer,
            dtype,
            shape: shape.to_vec(),
            offset: 0,
        };
        t.check_fits()?;
        Ok(t)
    }

    fn check_fits(&self) -> Result<()> {
        let need = self.byte_len()?;
        if self.offset + need > self.buffer.bytes() {
            return Err(CoreError::invalid(format!(
                "tensor {:?} of {need} bytes at offset {} does not fit a buffer of {} bytes",
                self.shape,
                self.offset,
                self.buffer.bytes()
            )));
        }
        Ok(())
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// Shape, outermost dimension first.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    /// Number of logical elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    /// Size of the last dimension (1 for a scalar).
    pub fn row_len(&self) -> usize {
        self.shape.last().copied().unwrap_or(1)
    }
    /// Number of rows: every dimension but the last, multiplied.
    pub fn rows(&self) -> usize {
        let n = self.shape.len();
        if n <= 1 {
            1
        } else {
            self.shape[..n - 1].iter().product()
        }
    }
    /// Bytes the view covers.
    pub fn byte_len(&self) -> Result<usize> {
        self.dtype.bytes_for(self.numel())
    }
    /// Offset of the view in bytes from the buffer start.
    pub fn offset(&self) -> usize {
        self.offset
    }
    /// The underlying buffer's id.
    pub fn buffer_id(&self) -> BufferId {
        self.buffer.id()
    }
    /// The underlying buffer.
    pub fn buffer(&self) -> &Arc<DeviceBuffer> {
        &self.buffer
    }

    /// The same memory with another shape of equal element count.
    pub fn reshape(&self, shape: &[usize]) -> Result<Tensor> {
        let n: usize = shape.iter().product();
        if n != self.numel() {
            return Err(CoreError::invalid(format!(
                "cannot reshape {:?} to {:?}",
                self.shape, shape
            )));
        }
        Ok(Tensor {
            buffer: self.buffer.clone(),
            dtype: self.dtype,
            shape: shape.to_vec(),
            offset: self.offset,
        })
    }

    /// Rows `start..start+len` of the outermost dimension.
    pub fn narrow(&self, start: usize, len: usize) -> Result<Tensor> {
        let outer = self.shape.first().copied().unwrap_or(1);
        if start + len > outer {
            return Err(CoreError::invalid(format!(
                "narrow {start}+{len} past dimension 0 of {:?}",
                self.shape
            )));
        }
        let inner: usize = self.shape.iter().skip(1).product();
        let row_bytes = self.dtype.bytes_for(inner)?;
        let mut shape = self.shape.clone();
        if shape.is_empty() {
            shape.push(len);
        } else {
            shape[0] = len;
        }
        Ok(Tensor {
            buffer: self.buffer.clone(),
            dtype: self.dtype,
            shape,
            offset: self.offset + start * row_bytes,
        })
    }

    /// Byte range this view covers inside its buffer.
    pub fn byte_range(&self) -> Result<std::ops::Range<usize>> {
        Ok(self.offset..self.offset + self.byte_len()?)
    }

    /// True if the two views share any byte of the same buffer.
    pub fn overlaps(&self, other: &Tensor) -> bool {
        if self.buffer_id() != other.buffer_id() {
            return false;
        }
        match (self.byte_range(), other.byte_range()) {
            (Ok(a), Ok(b)) => a.start < b.end && b.start < a.end,
            _ => true,
        }
    }

    /// An error unless this tensor (an output) shares no byte with any of
    /// `inputs`: the argument check of every backend operation.
    pub fn check_no_overlap(&self, inputs: &[&Tensor]) -> Result<()> {
        match inputs.iter().find(|i| self.overlaps(i)) {
            Some(i) => Err(CoreError::invalid(format!(
                "output {self:?} overlaps input {i:?}"
            ))),
            None => Ok(()),
        }
    }

    /// An error unless `other` has as many elements in rows of the same length.
    pub fn check_same_shape(&self, other: &Tensor) -> Result<()> {
        if self.numel() != other.numel() || self.row_len() != other.row_len() {
            return Err(CoreError::invalid(format!(
                "shape mismatch: {:?} vs {:?}",
                self.shape(),
                other.shape()
            )));
        }
        Ok(())
    }

    /// An error unless this tensor holds `dtype` elements.
    pub fn check_dtype(&self, dtype: DType) -> Result<()> {
        if self.dtype != dtype {
            return Err(CoreError::invalid(format!(
                "expected a {dtype} tensor, got {self:?}"
            )));
        }
        Ok(())
    }
}

/// A tensor in host memory, as read from a checkpoint or produced on the host.
#[derive(Clone, Debug)]
pub struct HostTensor<'a> {
    /// Element type of `data`.
    pub dtype: DType,
    /// Shape, outermost first.
    pub shape: Vec<usize>,
    /// Raw little-endian bytes.
    pub data: std::borrow::Cow<'a, [u8]>,
}

impl<'a> HostTensor<'a> {
    /// Checks that `data` has exactly the bytes the shape and dtype need.
    pub fn validate(&self, what: &str) -> Result<()> {
        let n: usize = self.shape.iter().product();
        let need = self.dtype.bytes_for(n)?;
        if need != self.data.len() {
            return Err(CoreError::load(format!(
                "{what}: {} bytes for {} {:?} (expected {need})",
                self.data.len(),
                self.dtype,
                self.shape
            )));
        }
        Ok(())
    }

    /// An owned f32 tensor.
    pub fn from_f32(shape: &[usize], values: &[f32]) -> HostTensor<'static> {
        let mut data = Vec::with_capacity(values.len() * 4);
        for v in values {
            data.extend_from_slice(&v.to_le_bytes());
        }
        HostTensor {
            dtype: DType::F32,
            shape: shape.to_vec(),
            data: std::borrow::Cow::Owned(data),
        }
    }

    /// Number of logical elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Converts a float tensor (f32, f16, bf16) to f32 values.
    pub fn to_f32_vec(&self) -> Result<Vec<f32>> {
        let d = &self.data;
        Ok(match self.dtype {
            DType::F32 => d
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            DType::F16 => d
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            DType::BF16 => d
                .chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            other => {
                return Err(CoreError::unsupported(format!(
                    "host conversion of {other} to f32"
                )));
            }
        })
    }

    /// Converts a float tensor to another float dtype.
    pub fn cast(&self, to: DType) -> Result<HostTensor<'static>> {
        if to == self.dtype {
            return Ok(HostTensor {
                dtype: self.dtype,
                shape: self.shape.clone(),
                data: std::borrow::Cow::Owned(self.data.to_vec()),
            });
        }
        let vals = self.to_f32_vec()?;
        let data: Vec<u8> = match to {
            DType::F32 => vals.iter().flat_map(|v| v.to_le_bytes()).collect(),
            DType::F16 => vals
                .iter()
                .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
                .collect(),
            DType::BF16 => vals
                .iter()
                .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
                .collect(),
            other => {
                return Err(CoreError::unsupported(format!(
                    "host cast from {} to {other}",
                    self.dtype
                )));
            }
        };
        Ok(HostTensor {
            dtype: to,
            shape: self.shape.clone(),
            data: std::borrow::Cow::Owned(data),
        })
    }
}

/// Named tensors of a checkpoint, read on demand.
pub trait WeightSource: Send + Sync {
    /// Where the weights come from (for error messages).
    fn describe(&self) -> String;
    /// The tensor under its Hugging Face name, or `None` when absent.
    fn tensor(&self, name: &str) -> crate::error::Result<Option<HostTensor<'_>>>;
}
