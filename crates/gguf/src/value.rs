//! GGUF metadata values: the 13 value types, scalars and (nested) arrays.
//!
//! Arrays are stored typed (`Vec<u32>`, `Vec<String>`, ...) rather than as
//! vectors of boxed values, so a 150k-entry vocabulary costs one allocation
//! per string and no more. Invariant: every array element has the array's
//! declared type; nested arrays carry their own type per element.

use std::fmt;

/// The GGUF value type ids (`gguf_type` in ggml).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GgufType {
    U8 = 0,
    I8 = 1,
    U16 = 2,
    I16 = 3,
    U32 = 4,
    I32 = 5,
    F32 = 6,
    Bool = 7,
    String = 8,
    Array = 9,
    U64 = 10,
    I64 = 11,
    F64 = 12,
}

impl GgufType {
    /// The type for a type id, or `None` for an unknown id.
    pub fn from_id(id: u32) -> Option<GgufType> {
        Some(match id {
            0 => GgufType::U8,
            1 => GgufType::I8,
            2 => GgufType::U16,
            3 => GgufType::I16,
            4 => GgufType::U32,
            5 => GgufType::I32,
            6 => GgufType::F32,
            7 => GgufType::Bool,
            8 => GgufType::String,
            9 => GgufType::Array,
            10 => GgufType::U64,
            11 => GgufType::I64,
            12 => GgufType::F64,
            _ => return None,
        })
    }

    /// The type id written in files.
    pub fn id(self) -> u32 {
        self as u32
    }

    /// The smallest number of bytes one value of this type takes in a file
    /// (a string's length prefix; an array's type and length header).
    pub fn min_encoded_size(self) -> u64 {
        match self {
            GgufType::U8 | GgufType::I8 | GgufType::Bool => 1,
            GgufType::U16 | GgufType::I16 => 2,
            GgufType::U32 | GgufType::I32 | GgufType::F32 => 4,
            GgufType::U64 | GgufType::I64 | GgufType::F64 | GgufType::String => 8,
            GgufType::Array => 12,
        }
    }

    /// Lowercase name used in error messages.
    pub fn name(self) -> &'static str {
        match self {
            GgufType::U8 => "u8",
            GgufType::I8 => "i8",
            GgufType::U16 => "u16",
            GgufType::I16 => "i16",
            GgufType::U32 => "u32",
            GgufType::I32 => "i32",
            GgufType::F32 => "f32",
            GgufType::Bool => "bool",
            GgufType::String => "string",
            GgufType::Array => "array",
            GgufType::U64 => "u64",
            GgufType::I64 => "i64",
            GgufType::F64 => "f64",
        }
    }
}

impl fmt::Display for GgufType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(GgufArray),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl GgufValue {
    /// The value's type.
    pub fn value_type(&self) -> GgufType {
        match self {
            GgufValue::U8(_) => GgufType::U8,
            GgufValue::I8(_) => GgufType::I8,
            GgufValue::U16(_) => GgufType::U16,
            GgufValue::I16(_) => GgufType::I16,
            GgufValue::U32(_) => GgufType::U32,
            GgufValue::I32(_) => GgufType::I32,
            GgufValue::F32(_) => GgufType::F32,
            GgufValue::Bool(_) => GgufType::Bool,
            GgufValue::String(_) => GgufType::String,
            GgufValue::Array(_) => GgufType::Array,
            GgufValue::U64(_) => GgufType::U64,
            GgufValue::I64(_) => GgufType::I64,
            GgufValue::F64(_) => GgufType::F64,
        }
    }

    /// A description of the type for error messages: `u32`, `array of string`.
    pub fn type_description(&self) -> String {
        match self {
            GgufValue::Array(a) => format!("array of {}", a.element_description()),
            other => other.value_type().name().to_string(),
        }
    }

    /// The value as a signed 128-bit integer, for any integer type.
    pub fn as_i128(&self) -> Option<i128> {
        Some(match *self {
            GgufValue::U8(v) => v.into(),
            GgufValue::I8(v) => v.into(),
            GgufValue::U16(v) => v.into(),
            GgufValue::I16(v) => v.into(),
            GgufValue::U32(v) => v.into(),
            GgufValue::I32(v) => v.into(),
            GgufValue::U64(v) => v.into(),
            GgufValue::I64(v) => v.into(),
            _ => return None,
        })
    }

    /// The value as f64, for float and integer types.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            GgufValue::F32(v) => Some(v.into()),
            GgufValue::F64(v) => Some(v),
            _ => self.as_i128().map(|v| v as f64),
        }
    }
}

/// A typed array value. Nested arrays hold one [`GgufArray`] per element.
#[derive(Clone, Debug, PartialEq)]
pub enum GgufArray {
    U8(Vec<u8>),
    I8(Vec<i8>),
    U16(Vec<u16>),
    I16(Vec<i16>),
    U32(Vec<u32>),
    I32(Vec<i32>),
    F32(Vec<f32>),
    Bool(Vec<bool>),
    String(Vec<String>),
    Array(Vec<GgufArray>),
    U64(Vec<u64>),
    I64(Vec<i64>),
    F64(Vec<f64>),
}

impl GgufArray {
    /// The element type.
    pub fn element_type(&self) -> GgufType {
        match self {
            GgufArray::U8(_) => GgufType::U8,
            GgufArray::I8(_) => GgufType::I8,
            GgufArray::U16(_) => GgufType::U16,
            GgufArray::I16(_) => GgufType::I16,
            GgufArray::U32(_) => GgufType::U32,
            GgufArray::I32(_) => GgufType::I32,
            GgufArray::F32(_) => GgufType::F32,
            GgufArray::Bool(_) => GgufType::Bool,
            GgufArray::String(_) => GgufType::String,
            GgufArray::Array(_) => GgufType::Array,
            GgufArray::U64(_) => GgufType::U64,
            GgufArray::I64(_) => GgufType::I64,
            GgufArray::F64(_) => GgufType::F64,
        }
    }

    /// The number of elements.
    pub fn len(&self) -> usize {
        match self {
            GgufArray::U8(v) => v.len(),
            GgufArray::I8(v) => v.len(),
            GgufArray::U16(v) => v.len(),
            GgufArray::I16(v) => v.len(),
            GgufArray::U32(v) => v.len(),
            GgufArray::I32(v) => v.len(),
            GgufArray::F32(v) => v.len(),
            GgufArray::Bool(v) => v.len(),
            GgufArray::String(v) => v.len(),
            GgufArray::Array(v) => v.len(),
            GgufArray::U64(v) => v.len(),
            GgufArray::I64(v) => v.len(),
            GgufArray::F64(v) => v.len(),
        }
    }

    /// True when the array has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Element type for messages, e.g. `string` or `array`.
    pub fn element_description(&self) -> &'static str {
        self.element_type().name()
    }

    /// The elements as i128 when the element type is an integer type.
    pub fn to_i128_vec(&self) -> Option<Vec<i128>> {
        fn conv<T: Copy + Into<i128>>(v: &[T]) -> Vec<i128> {
            v.iter().map(|&x| x.into()).collect()
        }
        Some(match self {
            GgufArray::U8(v) => conv(v),
            GgufArray::I8(v) => conv(v),
            GgufArray::U16(v) => conv(v),
            GgufArray::I16(v) => conv(v),
            GgufArray::U32(v) => conv(v),
            GgufArray::I32(v) => conv(v),
            GgufArray::U64(v) => conv(v),
            GgufArray::I64(v) => conv(v),
            _ => return None,
        })
    }
}
