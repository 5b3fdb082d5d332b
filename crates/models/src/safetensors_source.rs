//! Weights from `model.safetensors` or sharded safetensors with their index;
//! in a folder without safetensors, from `pytorch_model.bin` or its sharded
//! index (`pytorch_model.bin.index.json`), converted at open
//! ([`crate::torch_bin`]).
//!
//! Files are memory-mapped (converted checkpoints are held in memory); each
//! header is parsed once at open. A tensor is returned as a borrowed byte
//! slice of the map, after checking that its byte range lies inside the file
//! and matches its dtype and shape. Non-float tensors of a converted torch
//! checkpoint (buffers such as masks) are left out; in safetensors they are
//! an error.

use arbor_engine_core::{CoreError, DType, HostTensor, Result, WeightSource};
use memmap2::Mmap;
use safetensors::tensor::{Dtype, Metadata};
use std::borrow::Cow;
use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

struct Shard {
    path: PathBuf,
    map: ShardBytes,
    data_start: usize,
    meta: Metadata,
}

/// A shard's safetensors bytes.
enum ShardBytes {
    Mapped(Mmap),
    /// A torch checkpoint converted at open.
    Converted(Vec<u8>),
}

impl std::ops::Deref for ShardBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Self::Mapped(m) => m,
            Self::Converted(v) => v,
        }
    }
}

/// The safetensors files of a checkpoint folder.
pub struct SafetensorsSource {
    shards: Vec<Shard>,
    index: HashMap<String, usize>,
    dir: PathBuf,
}

fn map_file(path: &Path) -> Result<Mmap> {
    let f = File::open(path).map_err(|e| CoreError::io(path, e))?;
    // SAFETY: the map is read-only; checkpoints are not modified while loaded
    // (the same assumption every inference engine makes).
    #[allow(unsafe_code)]
    let map = unsafe { Mmap::map(&f) }.map_err(|e| CoreError::io(path, e))?;
    Ok(map)
}

/// The files of checkpoint `base` in `dir` (`base`, or the files its
/// `{base}.index.json` names, sorted); `None` when neither exists.
fn indexed_files(dir: &Path, base: &str) -> Result<Option<Vec<PathBuf>>> {
    let index_path = dir.join(format!("{base}.index.json"));
    let single = dir.join(base);
    if !index_path.exists() {
        return Ok(single.exists().then(|| vec![single]));
    }
    let text = std::fs::read_to_string(&index_path).map_err(|e| CoreError::io(&index_path, e))?;
    let v: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| CoreError::load(format!("{}: {e}", index_path.display())))?;
    let map = v
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| {
            CoreError::load(format!(
                "{}: key 'weight_map' is missing",
                index_path.display()
            ))
        })?;
    let mut files: Vec<PathBuf> = Vec::new();
    for (name, f) in map {
        let f = f.as_str().ok_or_else(|| {
            CoreError::load(format!(
                "{}: weight_map['{name}'] is not a file name",
                index_path.display()
            ))
        })?;
        if f.contains('/') || f.contains("..") {
            return Err(CoreError::load(format!(
                "{}: weight_map['{name}'] = '{f}' leaves the folder",
                index_path.display()
            )));
        }
        let p = dir.join(f);
        if !files.contains(&p) {
            files.push(p);
        }
    }
    files.sort();
    Ok(Some(files))
}

fn dtype_of(d: Dtype, name: &str, path: &Path) -> Result<DType> {
    Ok(match d {
        Dtype::F32 => DType::F32,
        Dtype::F16 => DType::F16,
        Dtype::BF16 => DType::BF16,
        Dtype::F8_E4M3 => DType::F8E4M3,
        Dtype::I32 => DType::I32,
        Dtype::U8 => DType::U8,
        other => {
            return Err(CoreError::load(format!(
                "{}: tensor '{name}' has dtype {other:?}; supported: F32, F16, BF16, F8_E4M3, I32, U8",
                path.display()
            )));
        }
    })
}

impl SafetensorsSource {
    /// Opens `model.safetensors` or `model.safetensors.index.json` in `dir`,
    /// else `pytorch_model.bin` or `pytorch_model.bin.index.json`.
    pub fn open(dir: &Path) -> Result<Self> {
        let (files, torch) = if let Some(f) = indexed_files(dir, "model.safetensors")? {
            (f, false)
        } else if let Some(f) = indexed_files(dir, "pytorch_model.bin")? {
            (f, true)
        } else {
            return Err(CoreError::load(format!(
                "{}: no model.safetensors, model.safetensors.index.json, pytorch_model.bin or pytorch_model.bin.index.json",
                dir.display()
            )));
        };
        let mut shards = Vec::new();
        let mut index = HashMap::new();
        for path in files {
            let map = if torch {
                ShardBytes::Converted(crate::torch_bin::to_safetensors(&path)?)
            } else {
                ShardBytes::Mapped(map_file(&path)?)
            };
            let (n, meta) = safetensors::SafeTensors::read_metadata(&map[..]).map_err(|e| {
                CoreError::load(format!(
                    "{}: invalid safetensors header: {e}",
                    path.display()
                ))
            })?;
            let data_start = 8 + n;
            for (name, info) in meta.tensors() {
                if torch && dtype_of(info.dtype, &name, &path).is_err() {
                    tracing::debug!("{}: skipping non-float tensor '{name}'", path.display());
                    continue;
                }
                let dt = dtype_of(info.dtype, &name, &path)?;
                let numel: usize = info.shape.iter().product();
                let (a, b) = info.data_offsets;
                if b < a || data_start + b > map.len() || dt.bytes_for(numel)? != b - a {
                    return Err(CoreError::load(format!(
                        "{}: tensor '{name}' has a byte range {a}..{b} that does not fit its shape {:?} or the file",
                        path.display(),
                        info.shape
                    )));
                }
                if index.insert(name.clone(), shards.len()).is_some() {
                    return Err(CoreError::load(format!(
                        "{}: tensor '{name}' appears in two shards",
                        path.display()
                    )));
                }
            }
            shards.push(Shard {
                path,
                map,
                data_start,
                meta,
            });
        }
        Ok(Self {
            shards,
            index,
            dir: dir.to_path_buf(),
        })
    }

    /// Names of all tensors.
    pub fn names(&self) -> Vec<String> {
        let mut v: Vec<String> = self.index.keys().cloned().collect();
        v.sort();
        v
    }
}

impl WeightSource for SafetensorsSource {
    fn describe(&self) -> String {
        let torch = self
            .shards
            .first()
            .is_some_and(|s| matches!(s.map, ShardBytes::Converted(_)));
        let kind = if torch {
            "pytorch_model.bin"
        } else {
            "safetensors"
        };
        format!("{kind} in {}", self.dir.display())
    }

    fn tensor(&self, name: &str) -> Result<Option<HostTensor<'_>>> {
        let Some(&si) = self.index.get(name) else {
            return Ok(None);
        };
        let shard = &self.shards[si];
        let tensors = shard.meta.tensors();
        let info = tensors
            .get(name)
            .ok_or_else(|| CoreError::Internal(format!("index lists missing tensor {name}")))?;
        let (a, b) = info.data_offsets;
        let data = &shard.map[shard.data_start + a..shard.data_start + b];
        Ok(Some(HostTensor {
            dtype: dtype_of(info.dtype, name, &shard.path)?,
            shape: info.shape.clone(),
            data: Cow::Borrowed(data),
        }))
    }
}
