//! The column operations (`arbor_engine_core::columns`) and the backend
//! defaults built on them (`linear_heads`, `concat_cols`), on the CPU
//! backend: exact column moves, per-head products against an f64 sum,
//! batch invariance, and errors for shapes that do not fit.

use anyhow::Result;
use arbor_backend_cpu::CpuBackend;
use arbor_engine_core::columns::{concat_cols_by_rows, take_cols};
use arbor_engine_core::{Backend, DType};

fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| ((i as u32).wrapping_mul(2_654_435_761) ^ seed) % 1000)
        .map(|v| v as f32 / 250.0 - 2.0)
        .collect()
}

/// Blocks taken at offsets of every common divisor come back exact, and a
/// block past the row is an error.
#[test]
fn take_cols_cuts_exact_blocks() -> Result<()> {
    let b = CpuBackend::new(1)?;
    let b: &dyn Backend = &b;
    let (m, n) = (3, 12);
    let v = values(m * n, 7);
    let x = b.upload_f32(&[m, n], &v)?;
    for (start, w) in [(0, 12), (3, 5), (0, 3), (8, 4), (11, 1), (4, 2)] {
        let got = take_cols(b, &x, start, w)?;
        assert_eq!(got.shape(), [m, w]);
        let want: Vec<f32> = (0..m)
            .flat_map(|r| v[r * n + start..r * n + start + w].to_vec())
            .collect();
        assert_eq!(
            b.download_f32(&got)?,
            want,
            "columns {start}..{}",
            start + w
        );
    }
    assert!(take_cols(b, &x, 8, 5).is_err());
    assert!(take_cols(b, &x, 0, 0).is_err());
    Ok(())
}

/// Parts of any widths join into one row each, in order, by the portable
/// form and by the CPU's own; widths that do not sum to the output's, or
/// parts of another row count, are errors.
#[test]
fn concat_cols_joins_parts_in_order() -> Result<()> {
    let b = CpuBackend::new(1)?;
    let b: &dyn Backend = &b;
    let m = 3;
    for widths in [vec![4, 6, 2], vec![64, 512], vec![1, 7], vec![5]] {
        let vals: Vec<Vec<f32>> = (0..widths.len())
            .map(|i| values(m * widths[i], i as u32))
            .collect();
        let parts: Vec<_> = widths
            .iter()
            .zip(&vals)
            .map(|(&w, v)| b.upload_f32(&[m, w], v))
            .collect::<arbor_engine_core::Result<_>>()?;
        let total = widths.iter().sum();
        let refs: Vec<_> = parts.iter().collect();
        // The portable form (the trait's default) and the CPU's own.
        let portable = b.alloc(DType::F32, &[m, total])?;
        concat_cols_by_rows(b, &refs, &portable)?;
        let out = b.alloc(DType::F32, &[m, total])?;
        b.concat_cols(&refs, &out)?;
        assert_eq!(b.download_f32(&portable)?, b.download_f32(&out)?);
        let want: Vec<f32> = (0..m)
            .flat_map(|r| {
                let (vals, widths) = (&vals, &widths);
                (0..widths.len())
                    .flat_map(move |i| vals[i][r * widths[i]..(r + 1) * widths[i]].iter().copied())
            })
            .collect();
        assert_eq!(b.download_f32(&out)?, want, "widths {widths:?}");
        let short = b.alloc(DType::F32, &[m, total + 1])?;
        assert!(
            b.concat_cols(&parts.iter().collect::<Vec<_>>(), &short)
                .is_err()
        );
    }
    let a = b.alloc(DType::F32, &[2, 4])?;
    let c = b.alloc(DType::F32, &[3, 4])?;
    assert!(
        b.concat_cols(&[&a, &c], &b.alloc(DType::F32, &[3, 8])?)
            .is_err()
    );
    assert!(b.concat_cols(&[], &b.alloc(DType::F32, &[3, 8])?).is_err());
    Ok(())
}

/// Each head's columns meet that head's weight rows (against an f64 sum);
/// a row alone gives the same bits as in the batch; shapes that do not
/// divide are errors.
#[test]
fn linear_heads_multiplies_each_head_by_its_own_rows() -> Result<()> {
    let b = CpuBackend::new(2)?;
    let b: &dyn Backend = &b;
    let (t, heads, a, k) = (5, 3, 8, 6);
    let xv = values(t * heads * a, 3);
    let wv = values(heads * k * a, 11);
    let x = b.upload_f32(&[t, heads * a], &xv)?;
    for dtype in [DType::F32, DType::BF16] {
        let w = b.upload_f32(&[heads * k, a], &wv)?;
        let w = if dtype == DType::F32 {
            w
        } else {
            let host: Vec<u8> = wv
                .iter()
                .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
                .collect();
            b.upload(&arbor_engine_core::HostTensor {
                dtype,
                shape: vec![heads * k, a],
                data: host.into(),
            })?
        };
        let out = b.alloc(DType::F32, &[t, heads * k])?;
        b.linear_heads(&x, &w, heads, &out)?;
        let got = b.download_f32(&out)?;
        let tol = if dtype == DType::F32 { 1e-4 } else { 0.1 };
        for r in 0..t {
            for h in 0..heads {
                for j in 0..k {
                    let want: f64 = (0..a)
                        .map(|i| {
                            f64::from(xv[r * heads * a + h * a + i])
                                * f64::from(wv[(h * k + j) * a + i])
                        })
                        .sum();
                    let g = got[r * heads * k + h * k + j];
                    assert!(
                        (f64::from(g) - want).abs() < tol,
                        "{dtype}: row {r} head {h} col {j}: {g} vs {want}"
                    );
                }
            }
        }
        // Row 2 alone gives the same bits as in the batch of 5.
        let one = b.alloc(DType::F32, &[1, heads * k])?;
        b.linear_heads(&x.narrow(2, 1)?, &w, heads, &one)?;
        assert_eq!(b.download_f32(&one)?, got[2 * heads * k..3 * heads * k]);
        let bad = b.alloc(DType::F32, &[t, heads * k + 1])?;
        assert!(b.linear_heads(&x, &w, heads, &bad).is_err());
        assert!(b.linear_heads(&x, &w, 0, &out).is_err());
        assert!(b.linear_heads(&x, &w, 2, &out).is_err());
    }
    Ok(())
}
