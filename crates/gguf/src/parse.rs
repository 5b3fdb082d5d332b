//! Parsing and validating a GGUF header: magic, version, metadata, tensor infos.
//!
//! Invariants on success (relied on by [`crate::GgufFile`]):
//! - every tensor's data range `offset..offset + bytes` lies inside the file;
//! - `bytes` is the ggml byte size of the tensor (rows a whole number of blocks),
//!   computed with overflow checks;
//! - offsets are multiples of the alignment; names and keys are unique.
//!
//! Defences against corrupt input: every read is bounds-checked (a short read
//! is `Truncated`, never a panic); a count or length is compared with the bytes
//! left in the file before anything is allocated for it, so a header claiming
//! 2^60 strings cannot make us allocate; array nesting is limited in depth so a
//! crafted file cannot overflow the stack.

use crate::error::{GgufError, Result};
use crate::ggml::{GgmlType, ggml_type};
use crate::value::{GgufArray, GgufType, GgufValue};
use arbor_engine_core::DType;
use std::collections::{BTreeMap, HashMap};

/// The GGUF magic bytes.
pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";
/// Alignment of tensor data when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// Most dimensions a tensor may have (ggml's `GGML_MAX_DIMS`).
pub const MAX_DIMS: u32 = 4;
/// Deepest array nesting accepted in metadata.
pub const MAX_ARRAY_DEPTH: usize = 4;

/// Smallest encoding of one metadata entry: key length, type, one byte of value.
const MIN_KV_BYTES: u64 = 8 + 4 + 1;
/// Smallest encoding of one tensor info: name length, n_dims, type, offset.
const MIN_TENSOR_INFO_BYTES: u64 = 8 + 4 + 4 + 8;

/// One tensor of the file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    /// The GGUF (llama.cpp) tensor name, e.g. `blk.0.attn_q.weight`.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Dimensions, outermost first (ggml's `ne` reversed): a linear weight is
    /// `[out_features, in_features]`.
    pub shape: Vec<usize>,
    /// Absolute byte offset of the data in the file.
    pub offset: u64,
    /// Size of the data in bytes.
    pub bytes: usize,
}

impl TensorInfo {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// ggml's `ne`: dimensions innermost first.
    pub fn ne(&self) -> Vec<usize> {
        self.shape.iter().rev().copied().collect()
    }
}

/// The parsed header.
pub(crate) struct Header {
    pub version: u32,
    pub metadata: BTreeMap<String, GgufValue>,
    pub tensors: Vec<TensorInfo>,
    pub index: HashMap<String, usize>,
    pub alignment: u64,
    pub data_offset: u64,
}

/// A bounds-checked little-endian reader over the file's bytes.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> u64 {
        (self.buf.len() - self.pos.min(self.buf.len())) as u64
    }

    fn take(&mut self, n: u64, what: &dyn Fn() -> String) -> Result<&'a [u8]> {
        let available = self.remaining();
        if n > available {
            return Err(GgufError::Truncated {
                what: what(),
                offset: self.pos as u64,
                needed: n,
                available,
            });
        }
        let start = self.pos;
        let end = start + n as usize;
        self.pos = end;
        self.buf
            .get(start..end)
            .ok_or_else(|| GgufError::Truncated {
                what: what(),
                offset: start as u64,
                needed: n,
                available,
            })
    }

    fn array<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N]> {
        let bytes = self.take(N as u64, what)?;
        let mut out = [0u8; N];
        out.copy_from_slice(bytes);
        Ok(out)
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// Fails unless `count` items of at least `min_size` bytes each fit in what is left.
    fn check_count(&self, count: u64, min_size: u64, what: &dyn Fn() -> String) -> Result<()> {
        let available = self.remaining();
        match count.checked_mul(min_size) {
            Some(total) if total <= available => Ok(()),
            _ => Err(GgufError::CountTooLarge {
                what: what(),
                offset: self.pos as u64,
                count,
                available,
            }),
        }
    }

    fn string(&mut self, what: &dyn Fn() -> String) -> Result<String> {
        let len = self.u64(&|| format!("length of {}", what()))?;
        let offset = self.pos as u64;
        let bytes = self.take(len, what)?;
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(s.to_owned()),
            Err(_) => Err(GgufError::InvalidUtf8 {
                what: what(),
                offset,
            }),
        }
    }
}

/// Reads `count` fixed-size scalars with `conv`.
fn scalars<T, const N: usize>(
    cur: &mut Cursor<'_>,
    count: u64,
    what: &dyn Fn() -> String,
    conv: fn([u8; N]) -> T,
) -> Result<Vec<T>> {
    cur.check_count(count, N as u64, what)?;
    let bytes = cur.take(count * N as u64, what)?;
    Ok(bytes
        .chunks_exact(N)
        .map(|c| {
            let mut a = [0u8; N];
            a.copy_from_slice(c);
            conv(a)
        })
        .collect())
}

fn value_type(key: &str, id: u32) -> Result<GgufType> {
    GgufType::from_id(id).ok_or_else(|| GgufError::UnknownValueType {
        key: key.to_string(),
        type_id: id,
    })
}

fn read_value(cur: &mut Cursor<'_>, ty: GgufType, key: &str, depth: usize) -> Result<GgufValue> {
    let what = || format!("value of metadata key '{key}'");
    Ok(match ty {
        GgufType::U8 => GgufValue::U8(u8::from_le_bytes(cur.array(&what)?)),
        GgufType::I8 => GgufValue::I8(i8::from_le_bytes(cur.array(&what)?)),
        GgufType::U16 => GgufValue::U16(u16::from_le_bytes(cur.array(&what)?)),
        GgufType::I16 => GgufValue::I16(i16::from_le_bytes(cur.array(&what)?)),
        GgufType::U32 => GgufValue::U32(u32::from_le_bytes(cur.array(&what)?)),
        GgufType::I32 => GgufValue::I32(i32::from_le_bytes(cur.array(&what)?)),
        GgufType::F32 => GgufValue::F32(f32::from_le_bytes(cur.array(&what)?)),
        GgufType::U64 => GgufValue::U64(u64::from_le_bytes(cur.array(&what)?)),
        GgufType::I64 => GgufValue::I64(i64::from_le_bytes(cur.array(&what)?)),
        GgufType::F64 => GgufValue::F64(f64::from_le_bytes(cur.array(&what)?)),
        GgufType::Bool => {
            let [b] = cur.array(&what)?;
            GgufValue::Bool(b != 0)
        }
        GgufType::String => GgufValue::String(cur.string(&what)?),
        GgufType::Array => GgufValue::Array(read_array(cur, key, depth + 1)?),
    })
}

fn read_array(cur: &mut Cursor<'_>, key: &str, depth: usize) -> Result<GgufArray> {
    if depth > MAX_ARRAY_DEPTH {
        return Err(GgufError::NestingTooDeep {
            key: key.to_string(),
            max: MAX_ARRAY_DEPTH,
        });
    }
    let type_id = cur.u32(&|| format!("element type of array '{key}'"))?;
    let ty = value_type(key, type_id)?;
    let len = cur.u64(&|| format!("length of array '{key}'"))?;
    let what = || format!("elements of array '{key}'");
    cur.check_count(len, ty.min_encoded_size(), &what)?;
    Ok(match ty {
        GgufType::U8 => GgufArray::U8(scalars(cur, len, &what, u8::from_le_bytes)?),
        GgufType::I8 => GgufArray::I8(scalars(cur, len, &what, i8::from_le_bytes)?),
        GgufType::U16 => GgufArray::U16(scalars(cur, len, &what, u16::from_le_bytes)?),
        GgufType::I16 => GgufArray::I16(scalars(cur, len, &what, i16::from_le_bytes)?),
        GgufType::U32 => GgufArray::U32(scalars(cur, len, &what, u32::from_le_bytes)?),
        GgufType::I32 => GgufArray::I32(scalars(cur, len, &what, i32::from_le_bytes)?),
        GgufType::F32 => GgufArray::F32(scalars(cur, len, &what, f32::from_le_bytes)?),
        GgufType::U64 => GgufArray::U64(scalars(cur, len, &what, u64::from_le_bytes)?),
        GgufType::I64 => GgufArray::I64(scalars(cur, len, &what, i64::from_le_bytes)?),
        GgufType::F64 => GgufArray::F64(scalars(cur, len, &what, f64::from_le_bytes)?),
        GgufType::Bool => GgufArray::Bool(scalars(cur, len, &what, |[b]: [u8; 1]| b != 0)?),
        GgufType::String => {
            // `check_count` bounded `len` by the bytes left, so this allocation is too.
            let mut out = Vec::with_capacity(len as usize);
            for i in 0..len {
                out.push(cur.string(&|| format!("element {i} of array '{key}'"))?);
            }
            GgufArray::String(out)
        }
        GgufType::Array => {
            let mut out = Vec::with_capacity(len as usize);
            for _ in 0..len {
                out.push(read_array(cur, key, depth + 1)?);
            }
            GgufArray::Array(out)
        }
    })
}

/// Reads the version and rejects versions and byte orders we do not read.
fn read_version(cur: &mut Cursor<'_>) -> Result<u32> {
    let version = cur.u32(&|| "version".to_string())?;
    match version {
        2 | 3 => Ok(version),
        1 => Err(GgufError::UnsupportedVersion(
            "GGUF version 1 is not supported (only versions 2 and 3); re-convert the model with a current llama.cpp".into(),
        )),
        v if matches!(v.swap_bytes(), 2 | 3) => Err(GgufError::UnsupportedVersion(format!(
            "this is a big-endian GGUF file (version {}); only little-endian files are supported",
            v.swap_bytes()
        ))),
        v => Err(GgufError::UnsupportedVersion(format!(
            "unsupported GGUF version {v} (only versions 2 and 3 are supported)"
        ))),
    }
}

fn alignment_of(metadata: &BTreeMap<String, GgufValue>) -> Result<u64> {
    const KEY: &str = "general.alignment";
    let Some(value) = metadata.get(KEY) else {
        return Ok(DEFAULT_ALIGNMENT);
    };
    let Some(v) = value.as_i128() else {
        return Err(GgufError::WrongType {
            key: KEY.into(),
            expected: "an integer (u32)",
            found: value.type_description(),
        });
    };
    if v <= 0 || v > i128::from(u32::MAX) || (v & (v - 1)) != 0 {
        return Err(GgufError::InvalidValue {
            key: KEY.into(),
            reason: format!("alignment {v} is not a power of two that fits in u32"),
        });
    }
    Ok(v as u64)
}

/// One tensor info as read, before its data range is known.
struct RawTensor {
    name: String,
    dtype: DType,
    ne: Vec<u64>,
    rel_offset: u64,
}

fn read_tensor_info(cur: &mut Cursor<'_>, i: u64) -> Result<RawTensor> {
    let name = cur.string(&|| format!("name of tensor #{i}"))?;
    let n_dims = cur.u32(&|| format!("number of dimensions of tensor '{name}'"))?;
    if n_dims > MAX_DIMS {
        return Err(GgufError::BadTensor {
            tensor: name,
            reason: format!("it has {n_dims} dimensions; at most {MAX_DIMS} are supported"),
        });
    }
    let mut ne = Vec::with_capacity(n_dims as usize);
    for d in 0..n_dims {
        ne.push(cur.u64(&|| format!("dimension {d} of tensor '{name}'"))?);
    }
    let type_id = cur.u32(&|| format!("type of tensor '{name}'"))?;
    let rel_offset = cur.u64(&|| format!("data offset of tensor '{name}'"))?;
    let dtype = match ggml_type(type_id) {
        GgmlType::Supported(d) => d,
        GgmlType::Unsupported(type_name) => {
            return Err(GgufError::UnsupportedTensorType {
                tensor: name,
                type_id,
                type_name,
            });
        }
        GgmlType::Unknown => {
            return Err(GgufError::UnknownTensorType {
                tensor: name,
                type_id,
            });
        }
    };
    Ok(RawTensor {
        name,
        dtype,
        ne,
        rel_offset,
    })
}

/// Element count and byte size of a tensor, overflow-checked.
fn tensor_size(t: &RawTensor) -> Result<(Vec<usize>, usize)> {
    let bad = |reason: String| GgufError::BadTensor {
        tensor: t.name.clone(),
        reason,
    };
    let mut numel: usize = 1;
    let mut shape = Vec::with_capacity(t.ne.len());
    for &n in t.ne.iter().rev() {
        let n = usize::try_from(n).map_err(|_| bad(format!("dimension {n} is too large")))?;
        numel = numel.checked_mul(n).ok_or_else(|| {
            bad(format!(
                "its dimensions {:?} overflow the element count",
                t.ne
            ))
        })?;
        shape.push(n);
    }
    let bs = t.dtype.block_size();
    let row = t.ne.first().copied().unwrap_or(1);
    if row % bs as u64 != 0 {
        return Err(bad(format!(
            "its rows of {row} elements are not a whole number of {} blocks of {bs}",
            t.dtype
        )));
    }
    let bytes = (numel / bs)
        .checked_mul(t.dtype.block_bytes())
        .ok_or_else(|| bad(format!("its byte size overflows (dimensions {:?})", t.ne)))?;
    // Same value as `DType::bytes_for`, which is now known not to overflow.
    let checked = t.dtype.bytes_for(numel).map_err(|e| bad(e.to_string()))?;
    debug_assert_eq!(checked, bytes);
    Ok((shape, bytes))
}

/// Parses and validates the whole header of `buf`, the complete file.
pub(crate) fn parse(buf: &[u8]) -> Result<Header> {
    let mut cur = Cursor { buf, pos: 0 };
    let magic: [u8; 4] = cur.array(&|| "magic".to_string())?;
    if magic != GGUF_MAGIC {
        return Err(GgufError::BadMagic {
            found: magic.to_vec(),
        });
    }
    let version = read_version(&mut cur)?;
    let n_tensors = cur.u64(&|| "tensor count".to_string())?;
    let n_kv = cur.u64(&|| "metadata count".to_string())?;
    cur.check_count(n_kv, MIN_KV_BYTES, &|| "metadata count".to_string())?;
    cur.check_count(n_tensors, MIN_TENSOR_INFO_BYTES, &|| {
        "tensor count".to_string()
    })?;

    let mut metadata = BTreeMap::new();
    for i in 0..n_kv {
        let key = cur.string(&|| format!("key of metadata entry #{i}"))?;
        let type_id = cur.u32(&|| format!("value type of metadata key '{key}'"))?;
        let ty = value_type(&key, type_id)?;
        let value = read_value(&mut cur, ty, &key, 0)?;
        if metadata.contains_key(&key) {
            return Err(GgufError::DuplicateKey(key));
        }
        metadata.insert(key, value);
    }
    let alignment = alignment_of(&metadata)?;

    cur.check_count(n_tensors, MIN_TENSOR_INFO_BYTES, &|| {
        "tensor count".to_string()
    })?;
    let mut raw = Vec::with_capacity(n_tensors as usize);
    for i in 0..n_tensors {
        raw.push(read_tensor_info(&mut cur, i)?);
    }

    let file_len = buf.len() as u64;
    let header_end = cur.pos as u64;
    let data_offset = header_end
        .checked_next_multiple_of(alignment)
        .ok_or_else(|| GgufError::InvalidValue {
            key: "general.alignment".into(),
            reason: format!("alignment {alignment} overflows the data offset"),
        })?;

    let mut tensors = Vec::with_capacity(raw.len());
    let mut index = HashMap::with_capacity(raw.len());
    for t in raw {
        let (shape, bytes) = tensor_size(&t)?;
        if t.rel_offset % alignment != 0 {
            return Err(GgufError::BadTensor {
                tensor: t.name,
                reason: format!(
                    "its data offset {} is not a multiple of the alignment {alignment}",
                    t.rel_offset
                ),
            });
        }
        let start = data_offset.checked_add(t.rel_offset);
        let end = start.and_then(|s| s.checked_add(bytes as u64));
        match (start, end) {
            (Some(start), Some(end)) if end <= file_len => {
                if index.contains_key(&t.name) {
                    return Err(GgufError::DuplicateTensor(t.name));
                }
                index.insert(t.name.clone(), tensors.len());
                tensors.push(TensorInfo {
                    name: t.name,
                    dtype: t.dtype,
                    shape,
                    offset: start,
                    bytes,
                });
            }
            (start, _) => {
                let start = start.unwrap_or(u64::MAX);
                return Err(GgufError::TensorOutOfBounds {
                    tensor: t.name,
                    start,
                    end: start.saturating_add(bytes as u64),
                    file_len,
                });
            }
        }
    }

    Ok(Header {
        version,
        metadata,
        tensors,
        index,
        alignment,
        data_offset,
    })
}
