//! PyTorch checkpoints (`pytorch_model.bin`, `torch.save`'s zip format since
//! torch 1.6), converted to safetensors bytes so that every reader of
//! safetensors takes them (published EAGLE and EAGLE3 heads ship this way).
//!
//! This module owns [`to_safetensors`]: it opens the zip archive, runs
//! `{prefix}/data.pkl` through a restricted unpickler and copies each
//! tensor's elements out of its storage record `{prefix}/data/{key}`.
//!
//! Invariants: the unpickler never imports or calls anything. It knows the
//! opcodes `torch.save` and `pickle` protocols 2–5 write for a state dict,
//! and only these globals: `collections.OrderedDict`, the
//! `torch._utils._rebuild_tensor*` and `_rebuild_parameter*` functions and
//! the typed storage classes (`torch.FloatStorage`, ...). Anything else is
//! an error that names it. Every storage read is bounds-checked against its
//! record (a truncated or hostile file is an error, never a panic), and
//! tensors are written row-major whatever their strides. Only
//! little-endian archives are read; the legacy (pre-zip) format is refused.

use arbor_engine_core::{CoreError, Result};
use safetensors::tensor::{Dtype, TensorView};
use std::collections::HashMap;
use std::io::Read;
use std::path::Path;

/// A tensor as the pickle describes it.
#[derive(Clone, Debug)]
struct TensorRef {
    key: String,
    dtype: Dtype,
    offset: usize,
    shape: Vec<usize>,
    stride: Vec<usize>,
}

/// A value on the unpickler's stack.
#[derive(Clone, Debug)]
enum Value {
    None,
    /// A bool, float or bytes value (never part of a tensor's description).
    Scalar,
    Int(i64),
    Str(String),
    Tuple(Vec<Value>),
    List(Vec<Value>),
    Dict(Vec<(Value, Value)>),
    /// A global that the unpickler knows (`module.name`).
    Global(String),
    /// A storage from a persistent id: its record key and element type.
    Storage(String, Dtype),
    Tensor(TensorRef),
}

/// Reads `path` (a `torch.save` zip archive) and returns the same tensors
/// as a safetensors file's bytes, in the pickle's order.
pub fn to_safetensors(path: &Path) -> Result<Vec<u8>> {
    let err = |m: String| CoreError::load(format!("{}: {m}", path.display()));
    let file = std::fs::File::open(path).map_err(|e| CoreError::io(path, e))?;
    let mut zip = zip::ZipArchive::new(file).map_err(|e| {
        err(format!(
            "not a torch.save zip archive ({e}); the legacy format of torch < 1.6 is not read: re-save it, or convert it to safetensors"
        ))
    })?;
    let pkl = (0..zip.len())
        .filter_map(|i| zip.name_for_index(i).map(str::to_string))
        .find(|n| n == "data.pkl" || n.ends_with("/data.pkl"))
        .ok_or_else(|| err("no data.pkl in the archive".into()))?;
    let prefix = pkl.trim_end_matches("data.pkl").to_string();
    let mut read = |name: &str| -> Result<Vec<u8>> {
        let mut f = zip
            .by_name(name)
            .map_err(|e| err(format!("record '{name}': {e}")))?;
        let mut v = Vec::with_capacity(f.size() as usize);
        f.read_to_end(&mut v)
            .map_err(|e| err(format!("record '{name}': {e}")))?;
        Ok(v)
    };
    if let Ok(order) = read(&format!("{prefix}byteorder"))
        && order != b"little"
    {
        return Err(err(format!(
            "byte order '{}' (only little-endian archives are read)",
            String::from_utf8_lossy(&order)
        )));
    }
    let root = Unpickler::new(&read(&pkl)?)
        .run()
        .map_err(|m| err(format!("data.pkl: {m}")))?;
    let entries = state_dict(root).map_err(|m| err(format!("data.pkl: {m}")))?;
    let mut storages: HashMap<String, Vec<u8>> = HashMap::new();
    let mut tensors: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, t) in entries {
        if !storages.contains_key(&t.key) {
            let bytes = read(&format!("{prefix}data/{}", t.key))?;
            storages.insert(t.key.clone(), bytes);
        }
        let data =
            gather(&storages[&t.key], &t).map_err(|m| err(format!("tensor '{name}': {m}")))?;
        tensors.push((name, t.dtype, t.shape, data));
    }
    let views = tensors
        .iter()
        .map(|(name, dtype, shape, data)| {
            TensorView::new(*dtype, shape.clone(), data)
                .map(|v| (name.clone(), v))
                .map_err(|e| err(format!("tensor '{name}': {e}")))
        })
        .collect::<Result<Vec<_>>>()?;
    safetensors::serialize(views, None).map_err(|e| err(format!("to safetensors: {e}")))
}

/// The (name, tensor) pairs of the pickled state dict (a dict, or a dict
/// under `state_dict` / `model` / `module`, as training scripts save them).
fn state_dict(root: Value) -> std::result::Result<Vec<(String, TensorRef)>, String> {
    let Value::Dict(items) = root else {
        return Err("the pickle is not a dict of tensors".into());
    };
    let nested = items.iter().find_map(|(k, v)| match (k, v) {
        (Value::Str(k), Value::Dict(_))
            if ["state_dict", "model", "module"].contains(&k.as_str()) =>
        {
            Some(v.clone())
        }
        _ => None,
    });
    if let Some(inner) = nested
        && !items.iter().any(|(_, v)| matches!(v, Value::Tensor(_)))
    {
        return state_dict(inner);
    }
    let mut out = Vec::with_capacity(items.len());
    for (k, v) in items {
        match (k, v) {
            (Value::Str(k), Value::Tensor(t)) => out.push((k, t)),
            // Non-tensor entries (a step count, a config) are not weights.
            (Value::Str(_), _) => {}
            (k, _) => return Err(format!("a state dict key that is not a string: {k:?}")),
        }
    }
    Ok(out)
}

/// The row-major bytes of `t` from its storage record.
fn gather(storage: &[u8], t: &TensorRef) -> std::result::Result<Vec<u8>, String> {
    let size = t.dtype.bitsize() / 8;
    let numel: usize = t.shape.iter().product();
    if t.stride.len() != t.shape.len() {
        return Err(format!(
            "{} strides for {} dimensions",
            t.stride.len(),
            t.shape.len()
        ));
    }
    let mut contiguous = true;
    let mut expect = 1usize;
    for (&n, &s) in t.shape.iter().zip(&t.stride).rev() {
        if n > 1 && s != expect {
            contiguous = false;
        }
        expect = expect.saturating_mul(n);
    }
    // The last element read, which must lie inside the record.
    let last = t.offset
        + t.shape
            .iter()
            .zip(&t.stride)
            .map(|(&n, &s)| n.saturating_sub(1).saturating_mul(s))
            .sum::<usize>();
    if numel > 0 && (last + 1).saturating_mul(size) > storage.len() {
        return Err(format!(
            "elements up to {} of a {}-byte storage record of {size}-byte elements",
            last + 1,
            storage.len()
        ));
    }
    if numel == 0 {
        return Ok(Vec::new());
    }
    if contiguous {
        let from = t.offset * size;
        return Ok(storage[from..from + numel * size].to_vec());
    }
    let mut out = Vec::with_capacity(numel * size);
    let mut index = vec![0usize; t.shape.len()];
    for _ in 0..numel {
        let at = t.offset
            + index
                .iter()
                .zip(&t.stride)
                .map(|(&i, &s)| i * s)
                .sum::<usize>();
        out.extend_from_slice(&storage[at * size..(at + 1) * size]);
        for d in (0..index.len()).rev() {
            index[d] += 1;
            if index[d] < t.shape[d] {
                break;
            }
            index[d] = 0;
        }
    }
    Ok(out)
}

/// The element type of a typed storage class.
fn storage_dtype(name: &str) -> Option<Dtype> {
    Some(match name {
        "torch.FloatStorage" => Dtype::F32,
        "torch.HalfStorage" => Dtype::F16,
        "torch.BFloat16Storage" => Dtype::BF16,
        "torch.DoubleStorage" => Dtype::F64,
        "torch.LongStorage" => Dtype::I64,
        "torch.IntStorage" => Dtype::I32,
        "torch.ShortStorage" => Dtype::I16,
        "torch.CharStorage" => Dtype::I8,
        "torch.ByteStorage" => Dtype::U8,
        "torch.BoolStorage" => Dtype::BOOL,
        _ => return None,
    })
}

/// The globals a state dict's pickle may name.
fn known_global(name: &str) -> bool {
    storage_dtype(name).is_some()
        || matches!(
            name,
            "collections.OrderedDict"
                | "torch._utils._rebuild_tensor"
                | "torch._utils._rebuild_tensor_v2"
                | "torch._utils._rebuild_parameter"
                | "torch._utils._rebuild_parameter_with_state"
        )
}

/// A restricted pickle machine over one `data.pkl`.
struct Unpickler<'a> {
    data: &'a [u8],
    pos: usize,
    stack: Vec<Value>,
    marks: Vec<usize>,
    memo: HashMap<u32, Value>,
}

type R<T> = std::result::Result<T, String>;

impl<'a> Unpickler<'a> {
    fn new(data: &'a [u8]) -> Self {
        Self {
            data,
            pos: 0,
            stack: Vec::new(),
            marks: Vec::new(),
            memo: HashMap::new(),
        }
    }

    fn take(&mut self, n: usize) -> R<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.data.len());
        let end = end.ok_or_else(|| format!("truncated at byte {}", self.pos))?;
        let s = &self.data[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn u8(&mut self) -> R<u8> {
        Ok(self.take(1)?[0])
    }

    fn u32(&mut self) -> R<u32> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn len_u64(&mut self) -> R<usize> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        usize::try_from(u64::from_le_bytes(a)).map_err(|_| "a length past usize".to_string())
    }

    fn line(&mut self) -> R<String> {
        let rest = &self.data[self.pos..];
        let n = rest
            .iter()
            .position(|&c| c == b'\n')
            .ok_or("an unterminated GLOBAL")?;
        let s = String::from_utf8_lossy(&rest[..n]).into_owned();
        self.pos += n + 1;
        Ok(s)
    }

    fn str(&mut self, n: usize) -> R<Value> {
        let b = self.take(n)?;
        String::from_utf8(b.to_vec())
            .map(Value::Str)
            .map_err(|_| "a string that is not UTF-8".into())
    }

    fn pop(&mut self) -> R<Value> {
        self.stack.pop().ok_or_else(|| "stack underflow".into())
    }

    fn top(&mut self) -> R<&mut Value> {
        self.stack
            .last_mut()
            .ok_or_else(|| "stack underflow".into())
    }

    /// The values pushed since the last MARK.
    fn pop_mark(&mut self) -> R<Vec<Value>> {
        let m = self.marks.pop().ok_or("no MARK")?;
        if m > self.stack.len() {
            return Err("a MARK past the stack".into());
        }
        Ok(self.stack.split_off(m))
    }

    fn global(&mut self, module: &str, name: &str) -> R<()> {
        let full = format!("{module}.{name}");
        if !known_global(&full) {
            return Err(format!(
                "global '{full}' is not part of a state dict (Arbor loads tensors only)"
            ));
        }
        self.stack.push(Value::Global(full));
        Ok(())
    }

    fn run(mut self) -> R<Value> {
        loop {
            let op = self.u8()?;
            let handled = match op {
                b'.' => return self.pop(),
                // PROTO and FRAME: a version byte and a frame length, skipped.
                0x80 => {
                    self.u8()?;
                    true
                }
                0x95 => {
                    self.len_u64()?;
                    true
                }
                _ => {
                    self.container_op(op)? || self.literal_op(op)? || self.memo_or_object_op(op)?
                }
            };
            if !handled {
                return Err(format!(
                    "unsupported pickle opcode 0x{op:02x} at byte {}",
                    self.pos - 1
                ));
            }
        }
    }

    /// Marks, tuples, lists and dicts, built and extended; false when `op` is not one of them.
    fn container_op(&mut self, op: u8) -> R<bool> {
        match op {
            b'(' => self.marks.push(self.stack.len()),
            b'}' => self.stack.push(Value::Dict(Vec::new())),
            b']' => self.stack.push(Value::List(Vec::new())),
            b')' => self.stack.push(Value::Tuple(Vec::new())),
            b't' => {
                let v = self.pop_mark()?;
                self.stack.push(Value::Tuple(v));
            }
            0x85..=0x87 => {
                let n = (op - 0x84) as usize;
                if self.stack.len() < n {
                    return Err("stack underflow".into());
                }
                let v = self.stack.split_off(self.stack.len() - n);
                self.stack.push(Value::Tuple(v));
            }
            b'l' => {
                let v = self.pop_mark()?;
                self.stack.push(Value::List(v));
            }
            b'd' => {
                let v = self.pop_mark()?;
                let d = pairs(v)?;
                self.stack.push(Value::Dict(d));
            }
            b'a' => {
                let v = self.pop()?;
                match self.top()? {
                    Value::List(l) => l.push(v),
                    _ => return Err("APPEND to a non-list".into()),
                }
            }
            b'e' => {
                let v = self.pop_mark()?;
                match self.top()? {
                    Value::List(l) => l.extend(v),
                    _ => return Err("APPENDS to a non-list".into()),
                }
            }
            b's' => {
                let v = self.pop()?;
                let k = self.pop()?;
                match self.top()? {
                    Value::Dict(d) => d.push((k, v)),
                    _ => return Err("SETITEM on a non-dict".into()),
                }
            }
            b'u' => {
                let v = pairs(self.pop_mark()?)?;
                match self.top()? {
                    Value::Dict(d) => d.extend(v),
                    _ => return Err("SETITEMS on a non-dict".into()),
                }
            }
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// Strings, bytes, integers, floats, booleans and None; false when `op` is not one of them.
    fn literal_op(&mut self, op: u8) -> R<bool> {
        match op {
            b'X' => {
                let n = self.u32()? as usize;
                let s = self.str(n)?;
                self.stack.push(s);
            }
            0x8c => {
                let n = self.u8()? as usize;
                let s = self.str(n)?;
                self.stack.push(s);
            }
            0x8d => {
                let n = self.len_u64()?;
                let s = self.str(n)?;
                self.stack.push(s);
            }
            b'T' | b'B' => {
                let n = self.u32()? as usize;
                let b = self.take(n)?.to_vec();
                self.stack.push(if op == b'T' {
                    Value::Str(String::from_utf8_lossy(&b).into_owned())
                } else {
                    Value::Scalar
                });
            }
            b'U' | b'C' => {
                let n = self.u8()? as usize;
                let b = self.take(n)?.to_vec();
                self.stack.push(if op == b'U' {
                    Value::Str(String::from_utf8_lossy(&b).into_owned())
                } else {
                    Value::Scalar
                });
            }
            b'K' => {
                let v = self.u8()?;
                self.stack.push(Value::Int(i64::from(v)));
            }
            b'M' => {
                let b = self.take(2)?;
                self.stack
                    .push(Value::Int(i64::from(u16::from_le_bytes([b[0], b[1]]))));
            }
            b'J' => {
                let v = self.u32()? as i32;
                self.stack.push(Value::Int(i64::from(v)));
            }
            0x8a => {
                let n = self.u8()? as usize;
                let b = self.take(n)?;
                if n > 8 {
                    return Err("an integer past 64 bits".into());
                }
                let mut a = [if b.last().is_some_and(|&x| x & 0x80 != 0) {
                    0xff
                } else {
                    0
                }; 8];
                a[..n].copy_from_slice(b);
                self.stack.push(Value::Int(i64::from_le_bytes(a)));
            }
            b'G' => {
                self.take(8)?;
                self.stack.push(Value::Scalar);
            }
            b'N' => self.stack.push(Value::None),
            0x88 | 0x89 => self.stack.push(Value::Scalar),
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// The memo (PUT and GET) and objects: globals, calls, persistent ids and BUILD; false when `op` is not one of them.
    fn memo_or_object_op(&mut self, op: u8) -> R<bool> {
        match op {
            b'q' => {
                let k = u32::from(self.u8()?);
                let v = self.top()?.clone();
                self.memo.insert(k, v);
            }
            b'r' => {
                let k = self.u32()?;
                let v = self.top()?.clone();
                self.memo.insert(k, v);
            }
            0x94 => {
                let k = self.memo.len() as u32;
                let v = self.top()?.clone();
                self.memo.insert(k, v);
            }
            b'h' | b'j' => {
                let k = if op == b'h' {
                    u32::from(self.u8()?)
                } else {
                    self.u32()?
                };
                let v = self.memo.get(&k).cloned().ok_or("a GET of an unset memo")?;
                self.stack.push(v);
            }
            b'c' => {
                let module = self.line()?;
                let name = self.line()?;
                self.global(&module, &name)?;
            }
            0x93 => {
                let (Value::Str(name), Value::Str(module)) = (self.pop()?, self.pop()?) else {
                    return Err("STACK_GLOBAL of non-strings".into());
                };
                self.global(&module, &name)?;
            }
            b'R' | 0x81 => {
                let args = self.pop()?;
                let f = self.pop()?;
                let v = call(f, args)?;
                self.stack.push(v);
            }
            b'Q' => {
                let pid = self.pop()?;
                let v = persistent(pid)?;
                self.stack.push(v);
            }
            // BUILD: an object's state (an OrderedDict's `_metadata`): not weights.
            b'b' => {
                self.pop()?;
            }
            _ => return Ok(false),
        }
        Ok(true)
    }
}

/// Alternating keys and values into pairs.
fn pairs(v: Vec<Value>) -> R<Vec<(Value, Value)>> {
    if !v.len().is_multiple_of(2) {
        return Err("an odd number of dict items".into());
    }
    let mut out = Vec::with_capacity(v.len() / 2);
    let mut it = v.into_iter();
    while let (Some(k), Some(x)) = (it.next(), it.next()) {
        out.push((k, x));
    }
    Ok(out)
}

/// A persistent id `('storage', storage class, key, location, numel)`.
fn persistent(pid: Value) -> R<Value> {
    let Value::Tuple(t) = pid else {
        return Err("a persistent id that is not a tuple".into());
    };
    match t.as_slice() {
        [Value::Str(kind), Value::Global(class), Value::Str(key), ..] if kind == "storage" => {
            let dtype = storage_dtype(class).ok_or_else(|| format!("storage class '{class}'"))?;
            Ok(Value::Storage(key.clone(), dtype))
        }
        _ => Err(format!("an unknown persistent id {t:?}")),
    }
}

fn usize_of(v: &Value) -> R<usize> {
    match v {
        Value::Int(i) => usize::try_from(*i).map_err(|_| format!("a negative size {i}")),
        _ => Err(format!("a size that is not an integer: {v:?}")),
    }
}

fn sizes(v: &Value) -> R<Vec<usize>> {
    match v {
        Value::Tuple(t) | Value::List(t) => t.iter().map(usize_of).collect(),
        _ => Err(format!("a shape that is not a tuple: {v:?}")),
    }
}

/// Applies a known global to its arguments.
fn call(f: Value, args: Value) -> R<Value> {
    let Value::Global(name) = f else {
        return Err("REDUCE of something that is not a known global".into());
    };
    let Value::Tuple(a) = args else {
        return Err(format!("{name} called without an argument tuple"));
    };
    match name.as_str() {
        "collections.OrderedDict" => Ok(Value::Dict(Vec::new())),
        "torch._utils._rebuild_tensor" | "torch._utils._rebuild_tensor_v2" => {
            let [Value::Storage(key, dtype), offset, shape, stride, ..] = a.as_slice() else {
                return Err(format!("{name} with arguments {a:?}"));
            };
            Ok(Value::Tensor(TensorRef {
                key: key.clone(),
                dtype: *dtype,
                offset: usize_of(offset)?,
                shape: sizes(shape)?,
                stride: sizes(stride)?,
            }))
        }
        "torch._utils._rebuild_parameter" | "torch._utils._rebuild_parameter_with_state" => a
            .into_iter()
            .next()
            .filter(|v| matches!(v, Value::Tensor(_)))
            .ok_or_else(|| format!("{name} without a tensor")),
        _ => Err(format!("global '{name}' cannot be called")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_what_is_not_a_state_dict() {
        // pickle.dumps(os.system, 2): an import the unpickler must refuse.
        let evil = b"\x80\x02cposix\nsystem\nq\x00.";
        let e = Unpickler::new(evil).run().unwrap_err();
        assert!(e.contains("posix.system"), "{e}");
        // Truncated input.
        let e = Unpickler::new(b"\x80\x02X\x10\x00\x00\x00ab")
            .run()
            .unwrap_err();
        assert!(e.contains("truncated"), "{e}");
    }

    #[test]
    fn gathers_strided_tensors_within_their_storage() {
        // A 2x3 f32 storage; the transposed view [3, 2] with strides (1, 3).
        let storage: Vec<u8> = (0..6u32).flat_map(|v| (v as f32).to_le_bytes()).collect();
        let t = TensorRef {
            key: "0".into(),
            dtype: Dtype::F32,
            offset: 0,
            shape: vec![3, 2],
            stride: vec![1, 3],
        };
        let got: Vec<f32> = gather(&storage, &t)
            .unwrap()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        assert_eq!(got, vec![0.0, 3.0, 1.0, 4.0, 2.0, 5.0]);
        let past = TensorRef {
            offset: 1,
            shape: vec![6],
            stride: vec![1],
            ..t
        };
        assert!(
            gather(&storage, &past)
                .unwrap_err()
                .contains("storage record")
        );
    }
}
