//! Reading an AMD GPU code object (the ELF that hiprtc makes): the kernels'
//! metadata note (`NT_AMDGPU_METADATA`, MessagePack), from which the hiprtc
//! test checks every kernel's parameters against the launch signatures and
//! reads register spills, static LDS and the wavefront size.
//!
//! Only what the metadata needs is decoded: ELF64 little-endian section
//! headers, `SHT_NOTE` sections, and the MessagePack subset the LLVM AMDGPU
//! backend writes (maps, arrays, strings, integers, booleans, floats, binary).
//! Malformed input is an error, never a panic.

use arbor_backend_gpu::kernels::Param;
use std::collections::HashMap;

/// A decoded MessagePack value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    Nil,
    Bool(bool),
    Int(i128),
    Float(f64),
    Str(String),
    Bin(Vec<u8>),
    Array(Vec<Value>),
    Map(Vec<(Value, Value)>),
}

impl Value {
    /// The entry of a map under string key `k`.
    pub fn get(&self, k: &str) -> Option<&Value> {
        match self {
            Value::Map(m) => m
                .iter()
                .find(|(key, _)| matches!(key, Value::Str(s) if s == k))
                .map(|(_, v)| v),
            _ => None,
        }
    }
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }
    pub fn as_int(&self) -> Option<i128> {
        match self {
            Value::Int(i) => Some(*i),
            _ => None,
        }
    }
    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.b.len());
        let end = end.ok_or_else(|| format!("MessagePack ends early at byte {}", self.at))?;
        let s = &self.b[self.at..end];
        self.at = end;
        Ok(s)
    }
    fn uint(&mut self, n: usize) -> Result<u64, String> {
        Ok(self.take(n)?.iter().fold(0u64, |a, &x| (a << 8) | x as u64))
    }
    fn int(&mut self, n: usize) -> Result<i128, String> {
        let u = self.uint(n)?;
        let shift = 64 - 8 * n as u32;
        Ok((((u << shift) as i64) >> shift) as i128)
    }
    fn str(&mut self, n: usize) -> Result<Value, String> {
        let s = self.take(n)?;
        Ok(Value::Str(String::from_utf8_lossy(s).into_owned()))
    }
    fn array(&mut self, n: usize, depth: usize) -> Result<Value, String> {
        let mut v = Vec::with_capacity(n.min(1024));
        for _ in 0..n {
            v.push(self.value(depth + 1)?);
        }
        Ok(Value::Array(v))
    }
    fn map(&mut self, n: usize, depth: usize) -> Result<Value, String> {
        let mut v = Vec::with_capacity(n.min(1024));
        for _ in 0..n {
            let k = self.value(depth + 1)?;
            v.push((k, self.value(depth + 1)?));
        }
        Ok(Value::Map(v))
    }
    fn value(&mut self, depth: usize) -> Result<Value, String> {
        if depth > 64 {
            return Err("MessagePack nested too deeply".into());
        }
        let t = self.take(1)?[0];
        let len = |r: &mut Self, n| r.uint(n).map(|v| v as usize);
        Ok(match t {
            0x00..=0x7f => Value::Int(t as i128),
            0x80..=0x8f => return self.map((t & 0x0f) as usize, depth),
            0x90..=0x9f => return self.array((t & 0x0f) as usize, depth),
            0xa0..=0xbf => return self.str((t & 0x1f) as usize),
            0xc0 => Value::Nil,
            0xc2 => Value::Bool(false),
            0xc3 => Value::Bool(true),
            0xc4..=0xc6 => {
                let n = len(self, 1 << (t - 0xc4))?;
                Value::Bin(self.take(n)?.to_vec())
            }
            0xca => Value::Float(f32::from_bits(self.uint(4)? as u32) as f64),
            0xcb => Value::Float(f64::from_bits(self.uint(8)?)),
            0xcc..=0xcf => Value::Int(self.uint(1 << (t - 0xcc))? as i128),
            0xd0..=0xd3 => Value::Int(self.int(1 << (t - 0xd0))?),
            0xd9..=0xdb => {
                let n = len(self, 1 << (t - 0xd9))?;
                return self.str(n);
            }
            0xdc | 0xdd => {
                let n = len(self, if t == 0xdc { 2 } else { 4 })?;
                return self.array(n, depth);
            }
            0xde | 0xdf => {
                let n = len(self, if t == 0xde { 2 } else { 4 })?;
                return self.map(n, depth);
            }
            0xe0..=0xff => Value::Int(t as i8 as i128),
            other => return Err(format!("unsupported MessagePack type 0x{other:02x}")),
        })
    }
}

/// Decodes one MessagePack value.
pub fn decode_msgpack(b: &[u8]) -> Result<Value, String> {
    Reader { b, at: 0 }.value(0)
}

fn le(b: &[u8], at: usize, n: usize) -> Result<u64, String> {
    let s = b
        .get(at..at + n)
        .ok_or_else(|| format!("ELF ends early at byte {at}"))?;
    Ok(s.iter().rev().fold(0u64, |a, &x| (a << 8) | x as u64))
}

/// The `NT_AMDGPU_METADATA` note of a code object, decoded.
pub fn metadata(elf: &[u8]) -> Result<Value, String> {
    if !elf.starts_with(b"\x7fELF") || elf.get(4) != Some(&2) || elf.get(5) != Some(&1) {
        return Err("not a little-endian ELF64 code object".into());
    }
    let shoff = le(elf, 0x28, 8)? as usize;
    let shentsize = le(elf, 0x3a, 2)? as usize;
    let shnum = le(elf, 0x3c, 2)? as usize;
    for i in 0..shnum {
        let sh = shoff + i * shentsize;
        if le(elf, sh + 4, 4)? != 7 {
            continue; // not SHT_NOTE
        }
        let (off, size) = (
            le(elf, sh + 0x18, 8)? as usize,
            le(elf, sh + 0x20, 8)? as usize,
        );
        let mut at = off;
        while at + 12 <= off + size {
            let namesz = le(elf, at, 4)? as usize;
            let descsz = le(elf, at + 4, 4)? as usize;
            let ty = le(elf, at + 8, 4)?;
            let name_at = at + 12;
            let desc_at = name_at + namesz.next_multiple_of(4);
            let name = elf.get(name_at..name_at + namesz).unwrap_or_default();
            if ty == 32 && name.starts_with(b"AMDGPU") {
                let desc = elf
                    .get(desc_at..desc_at + descsz)
                    .ok_or("the metadata note runs past the file")?;
                return decode_msgpack(desc);
            }
            at = desc_at + descsz.next_multiple_of(4);
        }
    }
    Err("no NT_AMDGPU_METADATA note in the code object".into())
}

/// What the metadata says of one kernel.
#[derive(Clone, Debug, PartialEq)]
pub struct KernelInfo {
    /// Explicit parameters (hidden ones dropped).
    pub params: Vec<Param>,
    pub sgpr_spills: i128,
    pub vgpr_spills: i128,
    /// Static LDS in bytes.
    pub group_segment: i128,
    pub wavefront_size: i128,
}

/// Every kernel of a code object's metadata, by name.
pub fn kernels(meta: &Value) -> Result<HashMap<String, KernelInfo>, String> {
    let list = meta
        .get("amdhsa.kernels")
        .and_then(Value::as_array)
        .ok_or("the metadata has no amdhsa.kernels")?;
    let mut out = HashMap::new();
    for k in list {
        let name = k
            .get(".name")
            .and_then(Value::as_str)
            .ok_or("a kernel without .name")?;
        let int = |key: &str| k.get(key).and_then(Value::as_int).unwrap_or(0);
        let mut params = Vec::new();
        for a in k.get(".args").and_then(Value::as_array).unwrap_or_default() {
            let kind = a.get(".value_kind").and_then(Value::as_str).unwrap_or("");
            let size = a.get(".size").and_then(Value::as_int).unwrap_or(0);
            params.push(match (kind, size) {
                ("global_buffer", 8) => Param::Pointer,
                ("by_value", 8) => Param::Value64,
                ("by_value", 4) => Param::Bits32,
                (k, _) if k.starts_with("hidden_") => continue,
                _ => Param::Other,
            });
        }
        out.insert(
            name.to_string(),
            KernelInfo {
                params,
                sgpr_spills: int(".sgpr_spill_count"),
                vgpr_spills: int(".vgpr_spill_count"),
                group_segment: int(".group_segment_fixed_size"),
                wavefront_size: int(".wavefront_size"),
            },
        );
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_the_subset_llvm_writes() {
        // {"a": [1, -1, 300, "x"], "b": true, "c": 1.5f32}
        let b = [
            0x83, 0xa1, b'a', 0x94, 0x01, 0xff, 0xcd, 0x01, 0x2c, 0xa1, b'x', 0xa1, b'b', 0xc3,
            0xa1, b'c', 0xca, 0x3f, 0xc0, 0x00, 0x00,
        ];
        let v = decode_msgpack(&b).unwrap();
        let a = v.get("a").and_then(Value::as_array).unwrap();
        assert_eq!(a[0], Value::Int(1));
        assert_eq!(a[1], Value::Int(-1));
        assert_eq!(a[2], Value::Int(300));
        assert_eq!(a[3].as_str(), Some("x"));
        assert_eq!(v.get("b"), Some(&Value::Bool(true)));
        assert_eq!(v.get("c"), Some(&Value::Float(1.5)));
        assert!(
            decode_msgpack(&b[..7]).is_err(),
            "truncated input is an error"
        );
        assert!(metadata(b"not an elf").is_err());
    }
}
