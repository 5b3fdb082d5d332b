//! Finding and reading data files: the default locations of the shared test
//! data (`../shared/data` next to the repository), and transparent gzip.
//!
//! Invariant: a default path is returned only if the file exists; callers
//! say what they looked for when nothing was found.

use crate::error::{BenchError, Result};
use flate2::read::GzDecoder;
use std::io::Read;
use std::path::{Path, PathBuf};

/// The default ShareGPT file, relative to the shared data folder.
pub const SHAREGPT: &str = "traces/sharegpt/ShareGPT_V3_first2500.json.gz";
/// The default Mooncake trace.
pub const MOONCAKE: &str = "traces/mooncake/conversation_trace.jsonl.gz";
/// The default Azure trace.
pub const AZURE: &str = "traces/azure/AzureLLMInferenceTrace_conv.csv.gz";

/// Candidate shared data folders: `../shared/data` from the current directory,
/// `shared/data` below it, and `../shared/data` from the repository root this
/// crate was built in.
pub fn data_dirs() -> Vec<PathBuf> {
    vec![
        PathBuf::from("../shared/data"),
        PathBuf::from("shared/data"),
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data"),
    ]
}

/// The first existing `dir/relative` over [`data_dirs`].
pub fn find_data_file(relative: &str) -> Option<PathBuf> {
    data_dirs()
        .into_iter()
        .map(|d| d.join(relative))
        .find(|p| p.is_file())
}

/// Reads a file as text, decompressing gzip (by magic bytes, whatever the name).
pub fn read_text(path: &Path) -> Result<String> {
    let bytes = std::fs::read(path).map_err(|e| BenchError::io(path, e))?;
    if bytes.starts_with(&[0x1f, 0x8b]) {
        let mut s = String::new();
        GzDecoder::new(&bytes[..])
            .read_to_string(&mut s)
            .map_err(|e| BenchError::io(path, e))?;
        Ok(s)
    } else {
        String::from_utf8(bytes).map_err(|e| BenchError::data(path, format!("not UTF-8: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn reads_plain_and_gzip() {
        let dir = tempfile::tempdir().unwrap();
        let plain = dir.path().join("a.txt");
        std::fs::write(&plain, "hello\n").unwrap();
        assert_eq!(read_text(&plain).unwrap(), "hello\n");
        let gz = dir.path().join("a.gz");
        let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        enc.write_all(b"zipped").unwrap();
        std::fs::write(&gz, enc.finish().unwrap()).unwrap();
        assert_eq!(read_text(&gz).unwrap(), "zipped");
        assert!(read_text(&dir.path().join("missing")).is_err());
    }
}
