//! [`GgufFile`]: a validated GGUF file over a memory map (or owned bytes).
//!
//! Owns the bytes for its whole life; the header is parsed and validated once
//! in [`GgufFile::open`] / [`GgufFile::from_bytes`], so afterwards every
//! tensor's data range is known to lie inside the bytes and `tensor_data`
//! cannot fail or read out of bounds. Typed metadata getters return
//! `Ok(None)` for an absent key and an error naming the key, the expected and
//! the found type for a present key of the wrong type.

use crate::error::{GgufError, Result};
use crate::parse::{self, TensorInfo};
use crate::value::{GgufArray, GgufValue};
use memmap2::Mmap;
use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::path::{Path, PathBuf};

enum Storage {
    Mapped(Mmap),
    Owned(Vec<u8>),
}

impl Storage {
    fn bytes(&self) -> &[u8] {
        match self {
            Storage::Mapped(m) => m,
            Storage::Owned(v) => v,
        }
    }
}

/// A GGUF file: metadata, tensor infos and the tensor bytes.
pub struct GgufFile {
    storage: Storage,
    path: Option<PathBuf>,
    version: u32,
    metadata: BTreeMap<String, GgufValue>,
    tensors: Vec<TensorInfo>,
    index: HashMap<String, usize>,
    alignment: u64,
    data_offset: u64,
}

impl fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("len", &self.storage.bytes().len())
            .field("metadata_keys", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .field("alignment", &self.alignment)
            .finish()
    }
}

/// Memory-maps `file` read-only.
#[allow(unsafe_code)]
fn map_file(file: &std::fs::File) -> std::io::Result<Mmap> {
    // SAFETY: the map is read-only and private to this process. The usual
    // caveat of file mappings applies: if another process truncates or
    // rewrites the file while it is mapped, reads may see the new bytes or
    // fault. Model files are not modified while being served; every other
    // property (bounds of each tensor) is validated against the mapped length.
    unsafe { Mmap::map(file) }
}

impl GgufFile {
    /// Opens, memory-maps and validates a GGUF file.
    pub fn open(path: &Path) -> Result<GgufFile> {
        let io = |source| GgufError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = std::fs::File::open(path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        let storage = if len == 0 {
            // Mapping an empty file fails on some platforms; let the parser
            // report it as a truncated file instead.
            Storage::Owned(Vec::new())
        } else {
            Storage::Mapped(map_file(&file).map_err(io)?)
        };
        Self::from_storage(storage, Some(path.to_path_buf()))
    }

    /// Validates a GGUF file held in memory (tests, fuzzing, embedded models).
    pub fn from_bytes(bytes: Vec<u8>) -> Result<GgufFile> {
        Self::from_storage(Storage::Owned(bytes), None)
    }

    fn from_storage(storage: Storage, path: Option<PathBuf>) -> Result<GgufFile> {
        let header = parse::parse(storage.bytes())?;
        Ok(GgufFile {
            storage,
            path,
            version: header.version,
            metadata: header.metadata,
            tensors: header.tensors,
            index: header.index,
            alignment: header.alignment,
            data_offset: header.data_offset,
        })
    }

    /// The path the file was opened from (`None` for `from_bytes`).
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// GGUF format version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// Alignment of tensor data (`general.alignment`, default 32).
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Absolute offset of the tensor data section.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    /// Size of the file in bytes.
    pub fn len(&self) -> usize {
        self.storage.bytes().len()
    }

    /// Always false for a valid file (the header takes bytes); here for clippy's sake.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// All metadata, by key.
    pub fn metadata(&self) -> &BTreeMap<String, GgufValue> {
        &self.metadata
    }

    /// The raw value of `key`.
    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.metadata.get(key)
    }

    fn wrong_type(key: &str, expected: &'static str, found: &GgufValue) -> GgufError {
        GgufError::WrongType {
            key: key.to_string(),
            expected,
            found: found.type_description(),
        }
    }

    /// A string value.
    pub fn get_str(&self, key: &str) -> Result<Option<&str>> {
        match self.metadata.get(key) {
            None => Ok(None),
            Some(GgufValue::String(s)) => Ok(Some(s)),
            Some(v) => Err(Self::wrong_type(key, "string", v)),
        }
    }

    /// A string value that must be present.
    pub fn require_str(&self, key: &str) -> Result<&str> {
        self.get_str(key)?
            .ok_or_else(|| GgufError::MissingKey(key.to_string()))
    }

    fn get_int(&self, key: &str, target: &'static str) -> Result<Option<i128>> {
        match self.metadata.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_i128()
                .map(Some)
                .ok_or_else(|| Self::wrong_type(key, target, v)),
        }
    }

    fn out_of_range(key: &str, value: i128, target: &'static str) -> GgufError {
        GgufError::OutOfRange {
            key: key.to_string(),
            value: value.to_string(),
            target,
        }
    }

    /// An unsigned integer; accepts any integer type whose value fits in u64.
    pub fn get_u64(&self, key: &str) -> Result<Option<u64>> {
        self.get_int(key, "an unsigned integer")?
            .map(|v| u64::try_from(v).map_err(|_| Self::out_of_range(key, v, "u64")))
            .transpose()
    }

    /// An unsigned integer that fits in u32.
    pub fn get_u32(&self, key: &str) -> Result<Option<u32>> {
        self.get_int(key, "an unsigned integer")?
            .map(|v| u32::try_from(v).map_err(|_| Self::out_of_range(key, v, "u32")))
            .transpose()
    }

    /// An unsigned integer that fits in usize (sizes, counts).
    pub fn get_usize(&self, key: &str) -> Result<Option<usize>> {
        self.get_int(key, "an unsigned integer")?
            .map(|v| usize::try_from(v).map_err(|_| Self::out_of_range(key, v, "usize")))
            .transpose()
    }

    /// A signed integer; accepts any integer type whose value fits in i64.
    pub fn get_i64(&self, key: &str) -> Result<Option<i64>> {
        self.get_int(key, "an integer")?
            .map(|v| i64::try_from(v).map_err(|_| Self::out_of_range(key, v, "i64")))
            .transpose()
    }

    /// A float; accepts f32, f64 (narrowed) and integers.
    pub fn get_f32(&self, key: &str) -> Result<Option<f32>> {
        match self.metadata.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(|x| Some(x as f32))
                .ok_or_else(|| Self::wrong_type(key, "a number (f32)", v)),
        }
    }

    /// A bool.
    pub fn get_bool(&self, key: &str) -> Result<Option<bool>> {
        match self.metadata.get(key) {
            None => Ok(None),
            Some(GgufValue::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(Self::wrong_type(key, "bool", v)),
        }
    }

    /// An array of any element type.
    pub fn get_array(&self, key: &str) -> Result<Option<&GgufArray>> {
        match self.metadata.get(key) {
            None => Ok(None),
            Some(GgufValue::Array(a)) => Ok(Some(a)),
            Some(v) => Err(Self::wrong_type(key, "array", v)),
        }
    }

    /// An array of strings.
    pub fn get_str_array(&self, key: &str) -> Result<Option<&[String]>> {
        match self.metadata.get(key) {
            None => Ok(None),
            Some(GgufValue::Array(GgufArray::String(v))) => Ok(Some(v)),
            Some(v) => Err(Self::wrong_type(key, "array of string", v)),
        }
    }

    /// An array of f32.
    pub fn get_f32_array(&self, key: &str) -> Result<Option<&[f32]>> {
        match self.metadata.get(key) {
            None => Ok(None),
            Some(GgufValue::Array(GgufArray::F32(v))) => Ok(Some(v)),
            Some(v) => Err(Self::wrong_type(key, "array of f32", v)),
        }
    }

    /// An array of i32.
    pub fn get_i32_array(&self, key: &str) -> Result<Option<&[i32]>> {
        match self.metadata.get(key) {
            None => Ok(None),
            Some(GgufValue::Array(GgufArray::I32(v))) => Ok(Some(v)),
            Some(v) => Err(Self::wrong_type(key, "array of i32", v)),
        }
    }

    /// An array of unsigned integers of any integer element type, each fitting in u64.
    pub fn get_u64_array(&self, key: &str) -> Result<Option<Vec<u64>>> {
        let Some(value) = self.metadata.get(key) else {
            return Ok(None);
        };
        let ints = match value {
            GgufValue::Array(a) => a.to_i128_vec(),
            _ => None,
        }
        .ok_or_else(|| Self::wrong_type(key, "array of integers", value))?;
        ints.into_iter()
            .map(|v| u64::try_from(v).map_err(|_| Self::out_of_range(key, v, "u64")))
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }

    /// An unsigned integer given either as a scalar or as a per-layer array
    /// (some architectures store e.g. `head_count` per layer): returns one
    /// value per entry, or a single-element vector for a scalar.
    pub fn get_u64_or_array(&self, key: &str) -> Result<Option<Vec<u64>>> {
        match self.metadata.get(key) {
            Some(GgufValue::Array(_)) => self.get_u64_array(key),
            _ => Ok(self.get_u64(key)?.map(|v| vec![v])),
        }
    }

    /// `general.architecture`, which every model file has.
    pub fn architecture(&self) -> Result<&str> {
        self.require_str("general.architecture")
    }

    /// An architecture-scoped key: `arch_key("block_count")` reads
    /// `<architecture>.block_count`.
    pub fn arch_key(&self, suffix: &str) -> Result<String> {
        Ok(format!("{}.{suffix}", self.architecture()?))
    }

    /// All tensors, in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// The info of one tensor.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.index.get(name).and_then(|&i| self.tensors.get(i))
    }

    /// The raw bytes of a tensor (ggml layout), or `None` when there is no such tensor.
    pub fn tensor_data(&self, name: &str) -> Result<Option<&[u8]>> {
        match self.tensor(name) {
            None => Ok(None),
            Some(info) => self.data_of(info).map(Some),
        }
    }

    /// The raw bytes described by `info` (which should come from this file).
    pub fn data_of(&self, info: &TensorInfo) -> Result<&[u8]> {
        let bytes = self.storage.bytes();
        let start = usize::try_from(info.offset).ok();
        let end = start.and_then(|s| s.checked_add(info.bytes));
        match (start, end) {
            (Some(s), Some(e)) if e <= bytes.len() => {
                bytes.get(s..e).ok_or_else(|| GgufError::TensorOutOfBounds {
                    tensor: info.name.clone(),
                    start: info.offset,
                    end: e as u64,
                    file_len: bytes.len() as u64,
                })
            }
            _ => Err(GgufError::TensorOutOfBounds {
                tensor: info.name.clone(),
                start: info.offset,
                end: info.offset.saturating_add(info.bytes as u64),
                file_len: bytes.len() as u64,
            }),
        }
    }
}
