//! Small GGUF files built in memory, shared by the reader and fuzz tests.
#![allow(dead_code)]

use arbor_engine_core::DType;
use arbor_gguf::{GgufArray, GgufValue, GgufWriter};

/// Deterministic bytes for tensor data.
pub fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// A file with every metadata value type, a nested array and tensors of
/// several dtypes (plain and block-quantized).
pub fn sample_writer() -> GgufWriter {
    let mut w = GgufWriter::new();
    w.add_str("general.architecture", "llama")
        .add_str("general.name", "tiny ünïcode 🦀")
        .add("t.u8", GgufValue::U8(200))
        .add("t.i8", GgufValue::I8(-5))
        .add("t.u16", GgufValue::U16(60000))
        .add("t.i16", GgufValue::I16(-300))
        .add_u32("llama.block_count", 2)
        .add("t.i32", GgufValue::I32(-70000))
        .add_f32("llama.rope.freq_base", 10000.5)
        .add_bool("t.bool", true)
        .add("t.u64", GgufValue::U64(1 << 40))
        .add("t.i64", GgufValue::I64(-(1 << 40)))
        .add("t.f64", GgufValue::F64(0.25))
        .add_array(
            "t.strs",
            GgufArray::String(vec!["a".into(), "".into(), "ß".into()]),
        )
        .add_array("t.f32s", GgufArray::F32(vec![1.0, -2.5]))
        .add_array("t.i32s", GgufArray::I32(vec![1, -2, 3]))
        .add_array("t.u8s", GgufArray::U8(vec![1, 2, 3]))
        .add_array("t.bools", GgufArray::Bool(vec![true, false]))
        .add_array(
            "t.nested",
            GgufArray::Array(vec![
                GgufArray::U32(vec![1, 2]),
                GgufArray::String(vec!["x".into()]),
                GgufArray::Array(vec![GgufArray::I64(vec![-1])]),
            ]),
        )
        .add_array("llama.attention.head_count", GgufArray::U32(vec![4, 4]));
    w.add_tensor("token_embd.weight", DType::F32, &[3, 4], pattern(48, 1))
        .expect("f32 tensor");
    w.add_tensor("blk.0.attn_q.weight", DType::Q4_0, &[2, 64], pattern(72, 2))
        .expect("q4_0 tensor");
    w.add_tensor(
        "blk.0.ffn_down.weight",
        DType::Q6_K,
        &[1, 256],
        pattern(210, 3),
    )
    .expect("q6_k tensor");
    w.add_tensor("output_norm.weight", DType::F16, &[5], pattern(10, 4))
        .expect("f16 tensor");
    w.add_tensor("blk.0.bias", DType::BF16, &[2, 1, 3], pattern(12, 5))
        .expect("bf16 tensor");
    w
}

/// A tiny byte-level BPE ("gpt2") vocabulary file: the 256 byte symbols, a few
/// merges and control tokens.
pub fn gpt2_vocab_writer(pre: &str) -> GgufWriter {
    // GPT-2's bytes_to_unicode.
    let mut bs: Vec<u32> = (b'!' as u32..=b'~' as u32)
        .chain(0xA1..=0xAC)
        .chain(0xAE..=0xFF)
        .collect();
    let mut cs = bs.clone();
    let mut n = 0;
    for b in 0..256u32 {
        if !bs.contains(&b) {
            bs.push(b);
            cs.push(256 + n);
            n += 1;
        }
    }
    let mut byte_chars: Vec<(u32, char)> = bs
        .iter()
        .zip(&cs)
        .map(|(&b, &c)| (b, char::from_u32(c).expect("valid char")))
        .collect();
    byte_chars.sort_unstable();
    let mut tokens: Vec<String> = vec![
        "<|endoftext|>".into(),
        "<|im_start|>".into(),
        "<|im_end|>".into(),
    ];
    tokens.extend(byte_chars.iter().map(|(_, c)| c.to_string()));
    let merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "Ġ Ġ", "1 2"];
    for m in merges {
        tokens.push(m.replace(' ', ""));
    }
    let mut types = vec![3i32; 3];
    types.extend(std::iter::repeat_n(1, tokens.len() - 3));
    let mut w = GgufWriter::new();
    w.add_str("general.architecture", "llama")
        .add_str("tokenizer.ggml.model", "gpt2")
        .add_str("tokenizer.ggml.pre", pre)
        .add_array("tokenizer.ggml.tokens", GgufArray::String(tokens))
        .add_array("tokenizer.ggml.token_type", GgufArray::I32(types))
        .add_array(
            "tokenizer.ggml.merges",
            GgufArray::String(merges.iter().map(|s| s.to_string()).collect()),
        )
        .add_u32("tokenizer.ggml.bos_token_id", 1)
        .add_u32("tokenizer.ggml.eos_token_id", 2)
        .add_bool("tokenizer.ggml.add_bos_token", true)
        .add_str("tokenizer.chat_template", "{{ messages }}");
    w
}
