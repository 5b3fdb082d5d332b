//! Linear layers through cuBLAS: `out[m, n] = x[m, k] · w[n, k]ᵀ (+ bias)`.
//!
//! Numerics: f32 weights multiply f32 activations exactly as an f32 GEMM
//! (`cublasGemmEx`, f32 inputs, `CUBLAS_COMPUTE_32F`, no TF32). For f16 and
//! bf16 weights the f32 activations are first rounded to the weight's type
//! (round to nearest even) in a scratch buffer, then multiplied on tensor
//! cores with f32 accumulation and an f32 output; this is the precision of a
//! PyTorch bf16/f16 model, whose activations are already in that type. Biases
//! are added in f32 by a separate kernel. The scaled blocks of HF quantized
//! checkpoints (`f8_s32`, `u4_s32`, `u8_s32`, `f4_s16`) stay packed in device memory
//! and are dequantized to an f32 scratch before each GEMM (exactly the CPU's
//! values), then multiplied as f32 weights: a dequantizing GEMM, until FP8
//! and FP4 tensor-core paths exist. [`GpuBackend::op_linear_many`]
//! rounds the shared input once for all its layers (Q/K/V, gate/up).

use crate::GpuBackend;
use crate::driver::Gemm;
use crate::exec::{Args, Op};
use crate::kernels::K;
use crate::ops::stride_grid;
use arbor_engine_core::{CoreError, DType, LinearRef, Result, Tensor};

/// The kernel that dequantizes a scaled weight dtype to f32, if it is one.
fn dequant_kernel(dtype: DType) -> Option<K> {
    match dtype {
        DType::F8_S32 => Some(K::DequantF8S32),
        DType::U4_S32 => Some(K::DequantU4S32),
        DType::U8_S32 => Some(K::DequantU8S32),
        DType::F4_S16 => Some(K::DequantF4S16),
        _ => None,
    }
}

impl GpuBackend {
    pub(crate) fn op_linear_many(&self, x: &Tensor, layers: &[LinearRef<'_>]) -> Result<()> {
        x.check_dtype(DType::F32)?;
        let (m, k) = (x.rows(), x.row_len());
        for (i, l) in layers.iter().enumerate() {
            let [n, wk] = *l.w.shape() else {
                return Err(CoreError::invalid(format!(
                    "linear weight {:?} is not 2-D",
                    l.w
                )));
            };
            if wk != k {
                return Err(CoreError::invalid(format!(
                    "linear input {x:?} does not match weight {:?}",
                    l.w
                )));
            }
            l.out.check_dtype(DType::F32)?;
            if l.out.rows() != m || l.out.row_len() != n {
                return Err(CoreError::invalid(format!(
                    "linear output {:?}, expected [{m}, {n}]",
                    l.out
                )));
            }
            if !matches!(l.w.dtype(), DType::F32 | DType::F16 | DType::BF16)
                && dequant_kernel(l.w.dtype()).is_none()
            {
                return Err(CoreError::unsupported(format!(
                    "CUDA linear with {} weights",
                    l.w.dtype()
                )));
            }
            let mut inputs = vec![x, l.w];
            if let Some(b) = l.bias {
                b.check_dtype(DType::F32)?;
                if b.numel() != n {
                    return Err(CoreError::invalid(format!("bias {b:?} for {n} outputs")));
                }
                inputs.push(b);
            }
            for other in &layers[..i] {
                inputs.push(other.out);
            }
            l.out.check_no_overlap(&inputs)?;
        }
        if layers.is_empty() || m == 0 {
            return Ok(());
        }
        let mut st = self.dev.lock()?;
        let mut row_tensors = vec![x];
        row_tensors.extend(layers.iter().map(|l| l.out));
        let rows = st.rows(m, &row_tensors);
        let xp = self.p(&st, x)?;
        // The rounded input, when some weight is 16-bit (one rounding per type).
        let mut half_in: Option<(DType, u64, Tensor)> = None;
        for l in layers {
            let n = l.w.shape()[0];
            // Scaled blocks: dequantized to an f32 scratch (exact), then the f32 GEMM.
            let mut wd = l.w.dtype();
            let mut wp = self.p(&st, l.w)?;
            let _scratch = match dequant_kernel(wd) {
                Some(kernel) => {
                    let scratch = self.alloc_in(&mut st, DType::F32, &[n * k], false)?;
                    let sp = self.p(&st, &scratch)?;
                    let args = Args::new().p(wp).p(sp).l((n * k) as u64);
                    self.dev.launch(
                        &mut st,
                        kernel,
                        [stride_grid(self, n * k), 1, 1],
                        256,
                        0,
                        args,
                    )?;
                    (wd, wp) = (DType::F32, sp);
                    Some(scratch)
                }
                None => None,
            };
            let xin = if wd == DType::F32 {
                xp
            } else {
                if half_in.as_ref().map(|h| h.0) != Some(wd) {
                    let scratch = self.alloc_in(&mut st, wd, &[rows * k], false)?;
                    let sp = self.p(&st, &scratch)?;
                    let n = rows * k;
                    let cast = if wd == DType::BF16 {
                        K::CastBf16
                    } else {
                        K::CastF16
                    };
                    let args = Args::new().p(xp).p(sp).l(n as u64);
                    self.dev
                        .launch(&mut st, cast, [stride_grid(self, n), 1, 1], 256, 0, args)?;
                    half_in = Some((wd, sp, scratch));
                }
                half_in.as_ref().map(|h| h.1).unwrap_or(xp)
            };
            let op = Op::Gemm(Gemm {
                dtype: wd,
                m: rows,
                n,
                k,
                w: wp,
                x: xin,
                out: self.p(&st, l.out)?,
            });
            self.dev.submit(&mut st, op)?;
            if let Some(b) = l.bias {
                let args = Args::new()
                    .p(self.p(&st, l.out)?)
                    .p(self.p(&st, b)?)
                    .i(rows)
                    .i(n);
                self.dev.launch(
                    &mut st,
                    K::AddBias,
                    [stride_grid(self, rows * n), 1, 1],
                    256,
                    0,
                    args,
                )?;
            }
        }
        Ok(())
    }
}
