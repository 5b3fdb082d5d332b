//! The GPU kernels' FP8 conversions (`kernels/fp8.cuh`), compiled for the
//! host with the system's C++ compiler, against the CPU backend's
//! (`arbor_quant::scaled`): every code decodes to the same value, and every
//! f32 tried (each code's value, the midpoints between neighbours and their
//! next floats either side, subnormals, saturation, infinities, NaN, and a
//! sweep over the exponent range) encodes to the same byte. An FP8 KV cache
//! written by a GPU then holds the CPU's bytes, which no GPU test can check
//! on a machine without one.
//!
//! Skips, printing why, when no C++ compiler (`$CXX`, else `c++`) runs;
//! `ARBOR_REQUIRE_CXX=1` turns that into a failure.

mod host;

use anyhow::{Context, Result, bail};
use arbor_quant::scaled::{e4m3_to_f32, e5m2_to_f32, f32_to_e4m3, f32_to_e5m2};
use std::process::Command;

const HARNESS: &str = r#"
#include <math.h>
#include <stdio.h>
#include <string.h>
#define __device__
#define __forceinline__ inline
typedef unsigned int u32;
static inline u32 __float_as_uint(float f) { u32 u; memcpy(&u, &f, 4); return u; }
static inline float __uint_as_float(u32 u) { float f; memcpy(&f, &u, 4); return f; }
template <typename T> T from_f32(float v);
"#;

const MAIN: &str = r#"
// stdin: one f32 bit pattern (hex) per line. stdout: the 256 decodes of
// each format as f32 bits, then per input its E4M3 and E5M2 codes.
int main() {
    for (int c = 0; c < 256; ++c) {
        e4m3_t a; a.x = (unsigned char)c;
        e5m2_t b; b.x = (unsigned char)c;
        printf("%08x %08x\n", __float_as_uint(to_f32(a)), __float_as_uint(to_f32(b)));
    }
    unsigned int u;
    while (scanf("%x", &u) == 1) {
        float v = __uint_as_float(u);
        printf("%02x %02x\n", from_f32<e4m3_t>(v).x, from_f32<e5m2_t>(v).x);
    }
    return 0;
}
"#;

/// The inputs tried: every code's value, the midpoints of neighbours and
/// the floats next to them, and a sweep of the f32 range.
fn inputs() -> Vec<f32> {
    let mut v = vec![
        0.0,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        -f32::NAN,
        f32::MAX,
        f32::MIN_POSITIVE,
        1e-30,
        448.0,
        464.0,
        480.0,
        57344.0,
        61440.0,
        1e6,
    ];
    for decode in [e4m3_to_f32 as fn(u8) -> f32, e5m2_to_f32] {
        let mut vals: Vec<f32> = (0..128u8).map(decode).filter(|x| x.is_finite()).collect();
        vals.sort_by(f32::total_cmp);
        vals.dedup();
        for w in vals.windows(2) {
            let mid = (w[0] + w[1]) / 2.0;
            for x in [
                w[0],
                mid,
                f32::from_bits(mid.to_bits() - 1),
                f32::from_bits(mid.to_bits() + 1),
            ] {
                v.push(x);
                v.push(-x);
            }
        }
    }
    // Every 4099th bit pattern of the positive and negative halves.
    v.extend((0..0x7f80_0000u32).step_by(4099).map(f32::from_bits));
    v.extend(
        (0x8000_0000..0xff80_0000u32)
            .step_by(4099)
            .map(f32::from_bits),
    );
    v
}

#[test]
fn gpu_fp8_conversions_match_the_cpu() -> Result<()> {
    let Some(cxx) = host::compiler("kernels/fp8.cuh")? else {
        return Ok(());
    };
    let dir = tempfile::tempdir()?;
    let fp8 = include_str!("../kernels/fp8.cuh");
    let bin = host::build(
        &cxx,
        dir.path(),
        "fp8_host",
        &format!("{HARNESS}\n{fp8}\n{MAIN}"),
    )?;
    let xs = inputs();
    let stdin: String = xs
        .iter()
        .map(|x| format!("{:08x}\n", x.to_bits()))
        .collect();
    let input = dir.path().join("in.txt");
    std::fs::write(&input, stdin)?;
    let run = Command::new(&bin)
        .stdin(std::fs::File::open(&input)?)
        .output()?;
    if !run.status.success() {
        bail!("fp8_host: {}", String::from_utf8_lossy(&run.stderr));
    }
    let text = String::from_utf8(run.stdout)?;
    let mut lines = text.lines();
    let hex = |s: &str| u32::from_str_radix(s, 16).context("hex");
    for c in 0..=255u8 {
        let line = lines.next().context("decode line")?;
        let (a, b) = line.split_once(' ').context("two decodes")?;
        for (what, got, want) in [
            ("E4M3", f32::from_bits(hex(a)?), e4m3_to_f32(c)),
            ("E5M2", f32::from_bits(hex(b)?), e5m2_to_f32(c)),
        ] {
            let same = got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan());
            assert!(same, "{what} code {c:#04x}: GPU {got} CPU {want}");
        }
    }
    let mut checked = 0;
    for &x in &xs {
        let line = lines.next().context("encode line")?;
        let (a, b) = line.split_once(' ').context("two codes")?;
        assert_eq!(
            hex(a)? as u8,
            f32_to_e4m3(x),
            "E4M3 of {x:e} ({:#010x})",
            x.to_bits()
        );
        assert_eq!(
            hex(b)? as u8,
            f32_to_e5m2(x),
            "E5M2 of {x:e} ({:#010x})",
            x.to_bits()
        );
        checked += 1;
    }
    assert!(lines.next().is_none(), "extra output");
    println!("256 codes decoded and {checked} f32 values encoded identically in both formats");
    Ok(())
}
