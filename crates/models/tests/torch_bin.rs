//! The torch checkpoint reader against files torch.save wrote
//! (tools/reference/make_torch_bin_fixture.py): every tensor of
//! tests/fixtures/torch-bin/mixed.bin (f32, f16, bf16, int64, a transposed
//! view, a view at an offset of a shared storage, a Parameter) has torch's
//! dtype, shape and values (mixed.json); a nested `state_dict` is found;
//! the EAGLE fixture head's pytorch_model.bin holds exactly its
//! model.safetensors tensors; and hostile or broken archives are refused
//! with a message, never a panic.

use anyhow::Result;
use arbor_models::torch_bin::to_safetensors;
use safetensors::SafeTensors;
use safetensors::tensor::Dtype;
use serde_json::Value;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

/// A tensor's elements as f64 (floats widened exactly; int64 as is).
fn values(dtype: Dtype, data: &[u8]) -> Vec<f64> {
    match dtype {
        Dtype::F32 => data
            .chunks_exact(4)
            .map(|c| f64::from(f32::from_le_bytes([c[0], c[1], c[2], c[3]])))
            .collect(),
        Dtype::F16 => data
            .chunks_exact(2)
            .map(|c| f64::from(half::f16::from_le_bytes([c[0], c[1]])))
            .collect(),
        Dtype::BF16 => data
            .chunks_exact(2)
            .map(|c| f64::from(half::bf16::from_le_bytes([c[0], c[1]])))
            .collect(),
        Dtype::I64 => data
            .chunks_exact(8)
            .map(|c| {
                let mut a = [0u8; 8];
                a.copy_from_slice(c);
                i64::from_le_bytes(a) as f64
            })
            .collect(),
        d => panic!("unexpected dtype {d:?}"),
    }
}

#[test]
fn mixed_state_dict_matches_torch() -> Result<()> {
    let dir = fixtures().join("torch-bin");
    let bytes = to_safetensors(&dir.join("mixed.bin"))?;
    let st = SafeTensors::deserialize(&bytes)?;
    let want: serde_json::Map<String, Value> =
        serde_json::from_str(&std::fs::read_to_string(dir.join("mixed.json"))?)?;
    assert_eq!(st.len(), want.len());
    for (name, w) in &want {
        let t = st.tensor(name)?;
        let dtype = match w["dtype"].as_str() {
            Some("float32") => Dtype::F32,
            Some("float16") => Dtype::F16,
            Some("bfloat16") => Dtype::BF16,
            Some("int64") => Dtype::I64,
            other => panic!("{other:?}"),
        };
        assert_eq!(t.dtype(), dtype, "{name}");
        let shape: Vec<usize> = w["shape"]
            .as_array()
            .unwrap_or(&Vec::new())
            .iter()
            .filter_map(|v| v.as_u64().map(|v| v as usize))
            .collect();
        assert_eq!(t.shape(), shape, "{name}");
        let got = values(dtype, t.data());
        let expect: Vec<f64> = w["values"]
            .as_array()
            .unwrap_or(&Vec::new())
            .iter()
            .filter_map(Value::as_f64)
            .collect();
        // Exact at the tensors' own precision (at most f32; the JSON's
        // decimal digits round-trip through f32, not always through f64).
        let f32s = |v: &[f64]| v.iter().map(|&x| x as f32).collect::<Vec<f32>>();
        assert_eq!(f32s(&got), f32s(&expect), "{name}");
    }
    Ok(())
}

#[test]
fn nested_state_dicts_and_the_eagle_head() -> Result<()> {
    let bytes = to_safetensors(&fixtures().join("torch-bin/nested.bin"))?;
    let st = SafeTensors::deserialize(&bytes)?;
    assert_eq!(st.names(), vec!["w"]);
    assert_eq!(values(Dtype::F32, st.tensor("w")?.data()), vec![1.0; 4]);
    let bin = to_safetensors(&fixtures().join("eagle-tiny-llama-bin/pytorch_model.bin"))?;
    let bin = SafeTensors::deserialize(&bin)?;
    let orig = std::fs::read(fixtures().join("eagle-tiny-llama/model.safetensors"))?;
    let orig = SafeTensors::deserialize(&orig)?;
    let mut names = orig.names();
    names.sort();
    let mut got = bin.names();
    got.sort();
    assert_eq!(got, names);
    for n in names {
        let (a, b) = (orig.tensor(n)?, bin.tensor(n)?);
        assert_eq!((a.dtype(), a.shape()), (b.dtype(), b.shape()), "{n}");
        assert!(a.data() == b.data(), "{n}: other bytes");
    }
    Ok(())
}

/// mixed.bin's records, with `edit` applied, in a new archive.
fn rewritten(edit: impl Fn(&str, Vec<u8>) -> Vec<u8>) -> Result<tempfile::NamedTempFile> {
    let mut zip =
        zip::ZipArchive::new(std::fs::File::open(fixtures().join("torch-bin/mixed.bin"))?)?;
    let out = tempfile::NamedTempFile::new()?;
    let mut w = zip::ZipWriter::new(std::fs::File::create(out.path())?);
    let opts =
        zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Stored);
    for i in 0..zip.len() {
        let mut f = zip.by_index(i)?;
        let name = f.name().to_string();
        let mut data = Vec::new();
        f.read_to_end(&mut data)?;
        w.start_file(name.as_str(), opts)?;
        w.write_all(&edit(&name, data))?;
    }
    w.finish()?;
    Ok(out)
}

#[test]
fn broken_and_hostile_archives_are_refused() -> Result<()> {
    // Not a zip archive (the legacy format, or another file renamed).
    let e = to_safetensors(&fixtures().join("eagle-tiny-llama/model.safetensors"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("not a torch.save zip archive"), "{e}");
    // A pickle that imports something else than a state dict's globals.
    let evil = rewritten(|name, data| {
        if name.ends_with("data.pkl") {
            b"\x80\x02cposix\nsystem\nq\x00X\x02\x00\x00\x00lsq\x01\x85q\x02Rq\x03.".to_vec()
        } else {
            data
        }
    })?;
    let e = to_safetensors(evil.path()).unwrap_err().to_string();
    assert!(e.contains("'posix.system'"), "{e}");
    // A storage record shorter than its tensors.
    let short = rewritten(|name, mut data| {
        if name.ends_with("data/0") {
            data.truncate(8);
        }
        data
    })?;
    let e = to_safetensors(short.path()).unwrap_err().to_string();
    assert!(
        e.contains("tensor 'a.f32'") && e.contains("storage record"),
        "{e}"
    );
    // A truncated pickle.
    let cut = rewritten(|name, mut data| {
        if name.ends_with("data.pkl") {
            data.truncate(data.len() / 2);
        }
        data
    })?;
    let e = to_safetensors(cut.path()).unwrap_err().to_string();
    assert!(e.contains("data.pkl"), "{e}");
    // Only little-endian archives.
    let big = rewritten(|name, data| {
        if name.ends_with("byteorder") {
            b"big".to_vec()
        } else {
            data
        }
    })?;
    let e = to_safetensors(big.path()).unwrap_err().to_string();
    assert!(e.contains("byte order 'big'"), "{e}");
    Ok(())
}
