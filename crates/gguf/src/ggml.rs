//! ggml tensor type ids and their mapping to engine-core's [`DType`].
//!
//! The ids are ggml's `enum ggml_type`; ids that ggml removed (4, 5, 31–33)
//! and ids past the known range are "unknown", known ids without a `DType`
//! (the IQ and ternary formats, I8/I16/I64/F64, MXFP4) are "unsupported".
//! Both are errors naming the tensor at open time.

use arbor_engine_core::DType;

/// What a ggml type id means to Arbor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GgmlType {
    /// A type Arbor reads, as a `DType`.
    Supported(DType),
    /// A ggml type Arbor has no kernels for; the ggml name.
    Unsupported(&'static str),
    /// An id ggml does not define (or no longer defines).
    Unknown,
}

/// Interprets a ggml type id.
pub fn ggml_type(id: u32) -> GgmlType {
    use GgmlType::{Supported as S, Unsupported as U};
    match id {
        0 => S(DType::F32),
        1 => S(DType::F16),
        2 => S(DType::Q4_0),
        3 => S(DType::Q4_1),
        6 => S(DType::Q5_0),
        7 => S(DType::Q5_1),
        8 => S(DType::Q8_0),
        9 => S(DType::Q8_1),
        10 => S(DType::Q2_K),
        11 => S(DType::Q3_K),
        12 => S(DType::Q4_K),
        13 => S(DType::Q5_K),
        14 => S(DType::Q6_K),
        15 => S(DType::Q8_K),
        16 => U("iq2_xxs"),
        17 => U("iq2_xs"),
        18 => U("iq3_xxs"),
        19 => U("iq1_s"),
        20 => U("iq4_nl"),
        21 => U("iq3_s"),
        22 => U("iq2_s"),
        23 => U("iq4_xs"),
        24 => U("i8"),
        25 => U("i16"),
        26 => S(DType::I32),
        27 => U("i64"),
        28 => U("f64"),
        29 => U("iq1_m"),
        30 => S(DType::BF16),
        34 => U("tq1_0"),
        35 => U("tq2_0"),
        39 => U("mxfp4"),
        _ => GgmlType::Unknown,
    }
}

/// The ggml type id of a `DType`, or `None` for types ggml lacks (U32, U8).
pub fn ggml_type_id(dtype: DType) -> Option<u32> {
    Some(match dtype {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::Q4_0 => 2,
        DType::Q4_1 => 3,
        DType::Q5_0 => 6,
        DType::Q5_1 => 7,
        DType::Q8_0 => 8,
        DType::Q8_1 => 9,
        DType::Q2_K => 10,
        DType::Q3_K => 11,
        DType::Q4_K => 12,
        DType::Q5_K => 13,
        DType::Q6_K => 14,
        DType::Q8_K => 15,
        DType::I32 => 26,
        DType::BF16 => 30,
        DType::U32
        | DType::U8
        | DType::F8E4M3
        | DType::F8E5M2
        | DType::F8_S32
        | DType::F8A8_S32
        | DType::U4_S32
        | DType::U8_S32
        | DType::F4_S16 => {
            return None;
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip() {
        for d in DType::ALL {
            if let Some(id) = ggml_type_id(d) {
                assert_eq!(ggml_type(id), GgmlType::Supported(d), "{d}");
            }
        }
        assert_eq!(ggml_type(4), GgmlType::Unknown);
        assert_eq!(ggml_type(1000), GgmlType::Unknown);
        assert_eq!(ggml_type(16), GgmlType::Unsupported("iq2_xxs"));
    }
}
