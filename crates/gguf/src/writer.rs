//! [`GgufWriter`]: writes GGUF v2/v3 files (small test models, fuzzing seeds).
//!
//! The layout is the one llama.cpp's writers produce: header, metadata, tensor
//! infos, padding to the alignment, then each tensor's data padded to the
//! alignment. `general.alignment` is written when the alignment is not 32.
//! Tensor shapes are given outermost first, like [`crate::TensorInfo::shape`].

use crate::error::{GgufError, Result};
use crate::file::GgufFile;
use crate::ggml::ggml_type_id;
use crate::parse::{DEFAULT_ALIGNMENT, GGUF_MAGIC};
use crate::value::{GgufArray, GgufValue};
use arbor_engine_core::DType;
use std::path::Path;

/// Builds a GGUF file in memory.
#[derive(Clone, Debug)]
pub struct GgufWriter {
    version: u32,
    alignment: u64,
    metadata: Vec<(String, GgufValue)>,
    tensors: Vec<(String, u32, Vec<u64>, Vec<u8>)>,
}

impl Default for GgufWriter {
    fn default() -> Self {
        Self::new()
    }
}

impl GgufWriter {
    /// An empty version-3 file with the default alignment.
    pub fn new() -> Self {
        GgufWriter {
            version: 3,
            alignment: DEFAULT_ALIGNMENT,
            metadata: Vec::new(),
            tensors: Vec::new(),
        }
    }

    /// A writer holding a copy of `file`'s metadata and tensors (to write a
    /// modified version of a file).
    pub fn from_file(file: &GgufFile) -> Result<Self> {
        let mut w = GgufWriter::new();
        w.set_version(file.version());
        if let Ok(a) = u32::try_from(file.alignment()) {
            w.set_alignment(a)?;
        }
        for (k, v) in file.metadata() {
            w.add(k.clone(), v.clone());
        }
        for t in file.tensors() {
            w.add_tensor(t.name.clone(), t.dtype, &t.shape, file.data_of(t)?.to_vec())?;
        }
        Ok(w)
    }

    /// Removes a metadata entry.
    pub fn remove(&mut self, key: &str) -> &mut Self {
        self.metadata.retain(|(k, _)| k != key);
        self
    }

    /// Sets the version written in the header.
    pub fn set_version(&mut self, version: u32) -> &mut Self {
        self.version = version;
        self
    }

    /// Sets the data alignment (a power of two); writes `general.alignment` unless 32.
    pub fn set_alignment(&mut self, alignment: u32) -> Result<&mut Self> {
        if alignment == 0 || !alignment.is_power_of_two() {
            return Err(GgufError::InvalidValue {
                key: "general.alignment".into(),
                reason: format!("alignment {alignment} is not a power of two"),
            });
        }
        self.alignment = alignment.into();
        self.metadata.retain(|(k, _)| k != "general.alignment");
        if alignment as u64 != DEFAULT_ALIGNMENT {
            self.metadata
                .push(("general.alignment".into(), GgufValue::U32(alignment)));
        }
        Ok(self)
    }

    /// Adds (or replaces) a metadata entry.
    pub fn add(&mut self, key: impl Into<String>, value: GgufValue) -> &mut Self {
        let key = key.into();
        self.metadata.retain(|(k, _)| *k != key);
        self.metadata.push((key, value));
        self
    }

    /// Adds a string entry.
    pub fn add_str(&mut self, key: impl Into<String>, value: impl Into<String>) -> &mut Self {
        self.add(key, GgufValue::String(value.into()))
    }

    /// Adds a u32 entry.
    pub fn add_u32(&mut self, key: impl Into<String>, value: u32) -> &mut Self {
        self.add(key, GgufValue::U32(value))
    }

    /// Adds an f32 entry.
    pub fn add_f32(&mut self, key: impl Into<String>, value: f32) -> &mut Self {
        self.add(key, GgufValue::F32(value))
    }

    /// Adds a bool entry.
    pub fn add_bool(&mut self, key: impl Into<String>, value: bool) -> &mut Self {
        self.add(key, GgufValue::Bool(value))
    }

    /// Adds an array entry.
    pub fn add_array(&mut self, key: impl Into<String>, value: GgufArray) -> &mut Self {
        self.add(key, GgufValue::Array(value))
    }

    /// Adds a tensor; `shape` is outermost first and `data` its ggml bytes.
    pub fn add_tensor(
        &mut self,
        name: impl Into<String>,
        dtype: DType,
        shape: &[usize],
        data: Vec<u8>,
    ) -> Result<&mut Self> {
        let name = name.into();
        let bad = |reason: String| GgufError::BadTensor {
            tensor: name.clone(),
            reason,
        };
        let type_id =
            ggml_type_id(dtype).ok_or_else(|| bad(format!("dtype {dtype} has no ggml type")))?;
        let numel = shape
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .ok_or_else(|| bad("element count overflows".into()))?;
        let want = dtype.bytes_for(numel).map_err(|e| bad(e.to_string()))?;
        if shape
            .last()
            .is_some_and(|&row| row % dtype.block_size() != 0)
        {
            return Err(bad(format!(
                "rows are not a whole number of {dtype} blocks"
            )));
        }
        if data.len() != want {
            return Err(bad(format!(
                "{} data bytes given, {want} expected for {dtype} {shape:?}",
                data.len()
            )));
        }
        let ne = shape.iter().rev().map(|&d| d as u64).collect();
        self.tensors.push((name, type_id, ne, data));
        Ok(self)
    }

    /// Adds a tensor with a raw ggml type id and `ne` (innermost first), unchecked.
    /// For building invalid files in tests.
    pub fn add_raw_tensor(
        &mut self,
        name: impl Into<String>,
        ggml_type: u32,
        ne: &[u64],
        data: Vec<u8>,
    ) -> &mut Self {
        self.tensors
            .push((name.into(), ggml_type, ne.to_vec(), data));
        self
    }

    /// The file's bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(&GGUF_MAGIC);
        out.extend_from_slice(&self.version.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (key, value) in &self.metadata {
            write_str(&mut out, key);
            out.extend_from_slice(&value.value_type().id().to_le_bytes());
            write_value(&mut out, value);
        }
        let align = self.alignment as usize;
        let mut offset = 0usize;
        for (name, type_id, ne, data) in &self.tensors {
            write_str(&mut out, name);
            out.extend_from_slice(&(ne.len() as u32).to_le_bytes());
            for d in ne {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&type_id.to_le_bytes());
            out.extend_from_slice(&(offset as u64).to_le_bytes());
            offset += data.len().next_multiple_of(align);
        }
        if !self.tensors.is_empty() {
            out.resize(out.len().next_multiple_of(align), 0);
        }
        for (_, _, _, data) in &self.tensors {
            out.extend_from_slice(data);
            out.resize(out.len().next_multiple_of(align), 0);
        }
        out
    }

    /// Writes the file.
    pub fn write(&self, path: &Path) -> Result<()> {
        std::fs::write(path, self.to_bytes()).map_err(|source| GgufError::Io {
            path: path.to_path_buf(),
            source,
        })
    }
}

fn write_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn write_value(out: &mut Vec<u8>, value: &GgufValue) {
    match value {
        GgufValue::U8(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::I8(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::U16(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::I16(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::U32(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::I32(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::F32(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::U64(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::I64(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::F64(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::Bool(v) => out.push(u8::from(*v)),
        GgufValue::String(s) => write_str(out, s),
        GgufValue::Array(a) => write_array(out, a),
    }
}

fn write_array(out: &mut Vec<u8>, a: &GgufArray) {
    out.extend_from_slice(&a.element_type().id().to_le_bytes());
    out.extend_from_slice(&(a.len() as u64).to_le_bytes());
    macro_rules! each {
        ($v:expr) => {
            for x in $v {
                out.extend_from_slice(&x.to_le_bytes());
            }
        };
    }
    match a {
        GgufArray::U8(v) => each!(v),
        GgufArray::I8(v) => each!(v),
        GgufArray::U16(v) => each!(v),
        GgufArray::I16(v) => each!(v),
        GgufArray::U32(v) => each!(v),
        GgufArray::I32(v) => each!(v),
        GgufArray::F32(v) => each!(v),
        GgufArray::U64(v) => each!(v),
        GgufArray::I64(v) => each!(v),
        GgufArray::F64(v) => each!(v),
        GgufArray::Bool(v) => out.extend(v.iter().map(|&b| u8::from(b))),
        GgufArray::String(v) => v.iter().for_each(|s| write_str(out, s)),
        GgufArray::Array(v) => v.iter().for_each(|inner| write_array(out, inner)),
    }
}
