//! The compute-device interface.
//!
//! A [`Backend`] owns device memory and runs the layer operations that models
//! call. It is designed for devices whose memory is not host memory and whose
//! work is queued asynchronously: tensors are handles, data crosses the
//! host↔device boundary only through [`Backend::upload`], [`Backend::write`]
//! and [`Backend::download`] (which waits for queued work), and an operation may
//! return before its result exists.
//!
//! Conventions shared by every operation: activations are `f32` and row-major;
//! a linear weight is `[out_features, in_features]` in any dtype the backend
//! lists in [`BackendCapabilities::weight_dtypes`]; outputs are written to
//! caller-provided tensors and must not overlap inputs unless an operation
//! says it works in place.

pub mod attention;
pub mod columns;
pub mod host_memory;
pub mod paging;
pub mod recurrent;

use crate::backend::attention::AttentionBackend;
use crate::dtype::DType;
use crate::error::{CoreError, Result};
use crate::tensor::{HostTensor, Tensor};
use std::sync::Arc;

/// What a device is.
#[derive(Clone, Debug, Default)]
pub struct DeviceInfo {
    /// Registered backend name (`cpu`, `cuda`, ...).
    pub backend: String,
    /// Human-readable device name (CPU model, GPU name, adapter).
    pub name: String,
    /// Total device memory in bytes, when known.
    pub total_memory: Option<u64>,
    /// Free device memory in bytes, when known.
    pub free_memory: Option<u64>,
    /// Worker threads (CPU) or multiprocessors (GPU), when meaningful.
    pub parallelism: Option<usize>,
}

/// What a backend can do, declared once.
#[derive(Clone, Debug)]
pub struct BackendCapabilities {
    /// Weight dtypes `linear` and `embedding` accept.
    pub weight_dtypes: Vec<DType>,
    /// Dtypes the KV cache may use.
    pub kv_dtypes: Vec<DType>,
    /// True when operations are queued and run asynchronously to the host.
    pub asynchronous: bool,
    /// Attention implementations this device offers, the default first.
    pub attention: Vec<&'static str>,
}

/// Layout of rotary embedding within a head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// Rotate the two halves of the rotary dimensions (HF `rotate_half`, GPT-NeoX).
    Neox,
    /// Rotate adjacent pairs `(2i, 2i+1)` (GPT-J, original Llama).
    Interleaved,
}

/// The sizes of a [`Backend::rope`] call, checked once for every backend:
/// rows of `x` are whole heads, one position per row, and the frequencies
/// cover at most the head (`2 * half <= head_dim`); `x` is rotated in place,
/// so it must not overlap the positions or the frequencies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RopeDims {
    /// Rows (tokens) of `x`.
    pub tokens: usize,
    /// Elements per row of `x`.
    pub width: usize,
    /// Heads per row.
    pub heads: usize,
    /// Rotary frequencies (half the rotated dims).
    pub half: usize,
}

impl RopeDims {
    /// Checks a rope call's arguments and returns its sizes.
    pub fn check(
        x: &Tensor,
        positions: &Tensor,
        inv_freq: &Tensor,
        head_dim: usize,
    ) -> Result<Self> {
        let (tokens, width) = (x.rows(), x.row_len());
        if head_dim == 0 || !width.is_multiple_of(head_dim) {
            return Err(CoreError::invalid(format!(
                "rope over rows of {width} with head_dim {head_dim}"
            )));
        }
        if positions.numel() != tokens {
            return Err(CoreError::invalid(format!(
                "rope: {} positions for {tokens} tokens",
                positions.numel()
            )));
        }
        let half = inv_freq.numel();
        if half == 0 || 2 * half > head_dim {
            return Err(CoreError::invalid(format!(
                "rope: {half} frequencies for head_dim {head_dim}"
            )));
        }
        x.check_no_overlap(&[positions, inv_freq])?;
        Ok(Self {
            tokens,
            width,
            heads: width / head_dim,
            half,
        })
    }
}

/// One linear layer of [`Backend::linear_many`].
#[derive(Clone, Copy, Debug)]
pub struct LinearRef<'a> {
    /// Weight `[n, k]`.
    pub w: &'a Tensor,
    /// Bias `[n]` f32.
    pub bias: Option<&'a Tensor>,
    /// Output `[m, n]` f32.
    pub out: &'a Tensor,
    /// The static scale `s` of the inputs of a W8A8 FP8 weight
    /// ([`DType::F8A8_S32`]) from its checkpoint's `input_scale`: each input
    /// is rounded to `e4m3(x · (1/s)) · s` (saturating at ±448), as vLLM's
    /// and SGLang's static FP8 activations are. `None`: the weight's own
    /// rule (`f8a8_s32`: a scale per run of 32 inputs, `max|x| / 448`).
    pub input_scale: Option<f32>,
}

impl<'a> LinearRef<'a> {
    /// `out = x · wᵀ (+ bias)` with the weight's own input rule.
    pub fn new(w: &'a Tensor, bias: Option<&'a Tensor>, out: &'a Tensor) -> Self {
        Self {
            w,
            bias,
            out,
            input_scale: None,
        }
    }

    /// [`LinearRef::input_scale`], checked: only a W8A8 FP8 weight takes
    /// one, and it is finite and positive.
    pub fn static_input_scale(&self) -> Result<Option<f32>> {
        let Some(s) = self.input_scale else {
            return Ok(None);
        };
        if self.w.dtype() != DType::F8A8_S32 {
            return Err(CoreError::invalid(format!(
                "a static input scale for {} weights {:?}: only W8A8 FP8 (f8a8_s32) rounds its inputs",
                self.w.dtype(),
                self.w
            )));
        }
        if !(s.is_finite() && s > 0.0) {
            return Err(CoreError::invalid(format!(
                "static input scale {s} of {:?}: it must be finite and positive",
                self.w
            )));
        }
        Ok(Some(s))
    }
}

/// One adapter's rows of [`Backend::lora_add`].
#[derive(Clone, Debug)]
pub struct LoraRows<'a> {
    /// Rows of `x` and `out` the adapter applies to.
    pub rows: std::ops::Range<usize>,
    /// Shrink factor `[r, in]` f32.
    pub a: &'a Tensor,
    /// Expand factor `[out, r]` f32 (scaled).
    pub b: &'a Tensor,
    /// `b` transposed, `[r, out]`.
    pub bt: &'a Tensor,
}

/// One row's parameters for [`Backend::sample`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SampleRow {
    /// Softmax temperature; below 1e-6 (or with `top_k == 1`) the row takes its argmax.
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens; 0 keeps all.
    pub top_k: u32,
    /// Nucleus mass in (0, 1]; 1 keeps all.
    pub top_p: f32,
    /// Drop tokens below `min_p` times the top probability; 0 keeps all.
    pub min_p: f32,
    /// Determines the random draw (e.g. the next value of the request's `SeqRng`).
    pub seed: u64,
}

impl SampleRow {
    /// The row of a request with `params`, its draw determined by `seed`.
    pub fn of(params: &crate::sampling::SamplingParams, seed: u64) -> Self {
        Self {
            temperature: if params.is_greedy() {
                0.0
            } else {
                params.temperature
            },
            top_k: u32::try_from(params.top_k).unwrap_or(0),
            top_p: params.top_p,
            min_p: params.min_p,
            seed,
        }
    }

    /// True when the row takes its argmax.
    pub fn is_greedy(&self) -> bool {
        self.temperature < 1e-6 || self.top_k == 1
    }

    /// Draws this row's token from its logits on the host: the argmax for a
    /// greedy row (no scratch copy), else the standard sampler seeded by `seed`.
    #[inline]
    pub fn draw(&self, logits: &[f32]) -> Result<u32> {
        use crate::sampling::{Sampler, SeqRng, StandardSampler};
        if self.is_greedy() {
            return Ok(crate::sampling::argmax(logits));
        }
        StandardSampler.sample(
            &mut logits.to_vec(),
            &self.params(),
            &mut SeqRng::new(self.seed),
        )
    }

    /// The sampling parameters this row draws with (the standard sampler's).
    pub fn params(&self) -> crate::sampling::SamplingParams {
        crate::sampling::SamplingParams {
            temperature: self.temperature,
            top_k: i32::try_from(self.top_k)
                .ok()
                .filter(|&k| k > 0)
                .unwrap_or(-1),
            top_p: self.top_p,
            min_p: self.min_p,
            ..crate::sampling::SamplingParams::default()
        }
    }
}

/// Options a backend is created with.
#[derive(Clone, Debug, Default)]
pub struct BackendOptions {
    /// Worker threads for CPU backends; 0 means one per physical core.
    pub threads: usize,
    /// Device index for multi-device backends.
    pub device_index: usize,
    /// Adapter name filter (wgpu).
    pub adapter: Option<String>,
    /// Run decode batches without CUDA graphs (`--disable-cuda-graph`).
    pub disable_cuda_graph: bool,
    /// Largest decode batch run as a CUDA graph; `None` lets the backend
    /// choose (`--cuda-graph-max-bs`).
    pub cuda_graph_max_bs: Option<usize>,
    /// How a CPU backend multiplies HF-quantized weights (`--cpu-quant-matmul`).
    pub cpu_quant_matmul: QuantMatmul,
}

/// How a CPU backend multiplies weights in the scaled block formats
/// ([`DType::F8_S32`], [`DType::U4_S32`], [`DType::U8_S32`],
/// [`DType::F4_S16`]: FP8, AWQ/GPTQ/W4A16 INT4, W8A16 INT8 and NVFP4
/// checkpoints). It is chosen once, when the backend is created, for every
/// layer and every batch, so a position's logits never depend on the batch
/// it shares a step with; GGUF formats keep their integer dots either way,
/// and W8A8 FP8 weights ([`DType::F8A8_S32`]) their E4M3 inputs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum QuantMatmul {
    /// f32 activations times the weights dequantized exactly to f32 (FMA):
    /// the fastest single-sequence decode.
    #[default]
    F32,
    /// On CPUs with AMX: the weights dequantized to bf16 (tile by tile or
    /// 64 rows at a time, in cache) meet bf16-rounded activations in AMX
    /// tiles, as bf16 weights do: several times faster for batches and
    /// prefill, slower for one sequence. Without AMX it is
    /// [`QuantMatmul::F32`].
    AmxBf16,
}

impl QuantMatmul {
    /// Every value, in the order the flag's help lists them.
    pub const ALL: [QuantMatmul; 2] = [QuantMatmul::F32, QuantMatmul::AmxBf16];

    /// The flag's spelling ("f32", "amx-bf16").
    pub const fn name(self) -> &'static str {
        match self {
            QuantMatmul::F32 => "f32",
            QuantMatmul::AmxBf16 => "amx-bf16",
        }
    }
}

impl std::str::FromStr for QuantMatmul {
    type Err = CoreError;
    /// The value [`QuantMatmul::name`] spells `s` (any case).
    fn from_str(s: &str) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|q| q.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| CoreError::Config(format!("must be f32 or amx-bf16, got '{s}'")))
    }
}

/// How long the host data given to [`Backend::write_async`] stays unchanged.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HostData {
    /// Until the call returns.
    Transient,
    /// Until the next [`Backend::synchronize`] returns.
    UntilSync,
}

/// Host bytes for [`Backend::write_async`]: `count` rows of `row` bytes,
/// `pitch` bytes apart from the start of `data` (one row when they are
/// contiguous). A tensor-parallel rank's heads within a host KV page, which
/// holds every rank's heads per slot, are such rows.
///
/// Invariant: `row <= pitch` and `data` covers the last row
/// (`(count - 1) · pitch + row` bytes), so every row lies in `data`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostRows<'a> {
    data: &'a [u8],
    row: usize,
    pitch: usize,
    count: usize,
}

impl<'a> HostRows<'a> {
    /// All of `data`, as one row.
    pub fn whole(data: &'a [u8]) -> Self {
        Self {
            data,
            row: data.len(),
            pitch: data.len(),
            count: 1,
        }
    }

    /// `count` rows of `row` bytes, `pitch` bytes apart, from the start of
    /// `data`; an error unless they lie in `data` without overlapping.
    pub fn strided(data: &'a [u8], row: usize, pitch: usize, count: usize) -> Result<Self> {
        let span = count
            .checked_sub(1)
            .map_or(Some(0), |c| c.checked_mul(pitch)?.checked_add(row));
        if row > pitch || span.is_none_or(|s| s > data.len()) {
            return Err(CoreError::invalid(format!(
                "{count} host rows of {row} bytes, {pitch} apart, in {} bytes",
                data.len()
            )));
        }
        Ok(Self {
            data,
            row,
            pitch,
            count,
        })
    }

    /// Bytes the rows hold together.
    pub fn len(&self) -> usize {
        self.row * self.count
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes per row, and the distance between row starts.
    pub fn row_and_pitch(&self) -> (usize, usize) {
        (self.row, self.pitch)
    }

    /// The rows, in order.
    pub fn rows(&self) -> impl Iterator<Item = &'a [u8]> + '_ {
        (0..self.count).map(|i| &self.data[i * self.pitch..i * self.pitch + self.row])
    }

    /// The rows as one slice, when they are contiguous.
    pub fn contiguous(&self) -> Option<&'a [u8]> {
        (self.count <= 1 || self.row == self.pitch).then(|| &self.data[..self.len()])
    }

    /// The bytes from the first row's start to the last row's end.
    pub fn span(&self) -> &'a [u8] {
        let end = self.count.saturating_sub(1) * self.pitch + self.row;
        &self.data[..end.min(self.data.len())]
    }

    /// The rows copied one after another.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(self.len());
        self.rows().for_each(|r| v.extend_from_slice(r));
        v
    }
}

/// A compute device: memory and the operations models call.
pub trait Backend: Send + Sync {
    /// Describes the device.
    fn info(&self) -> DeviceInfo;
    /// The capabilities of this device.
    fn capabilities(&self) -> &BackendCapabilities;

    /// Allocates a zero-filled tensor.
    fn alloc(&self, dtype: DType, shape: &[usize]) -> Result<Tensor>;
    /// Copies a host tensor to a new device tensor. The host data may be reused once this returns.
    fn upload(&self, host: &HostTensor<'_>) -> Result<Tensor>;
    /// Overwrites the whole view `dst` with `data` (exactly its byte length).
    fn write(&self, dst: &Tensor, data: &[u8]) -> Result<()>;
    /// [`write`](Self::write)s each host rows' bytes, one after another,
    /// into their view, where an asynchronous device may run the copies
    /// beside later work: only work that touches one of the destinations'
    /// buffers waits for them. `held` says how long the host data stays
    /// unchanged (with [`HostData::UntilSync`], data in this device's
    /// [`host_memory`](Self::host_memory) may be copied in place, strided
    /// rows included). HiCache's load-back writes each layer's pages with
    /// one call, so layer `l`'s attention waits only for layer `l`'s copies
    /// while later layers still load.
    fn write_async(&self, writes: &[(&Tensor, HostRows<'_>)], held: HostData) -> Result<()> {
        let _ = held;
        writes
            .iter()
            .try_for_each(|(dst, rows)| match rows.contiguous() {
                Some(data) => self.write(dst, data),
                None => self.write(dst, &rows.to_vec()),
            })
    }
    /// Host memory this device copies from and to fastest (pinned memory on
    /// GPUs), for the host KV tier; `None` when plain memory is as good.
    fn host_memory(&self) -> Option<Arc<dyn host_memory::HostMemory>> {
        None
    }
    /// Waits for queued work, then copies the view `src` into `dst` (exactly its byte length).
    fn download(&self, src: &Tensor, dst: &mut [u8]) -> Result<()>;
    /// Waits until all queued work has finished.
    fn synchronize(&self) -> Result<()>;
    /// Copies `src` into `dst` (same dtype and element count).
    fn copy(&self, src: &Tensor, dst: &Tensor) -> Result<()>;

    /// `out[i] = table[ids[i]]` as f32; `table` is `[vocab, dim]` in a weight dtype, `ids` u32.
    fn embedding(&self, table: &Tensor, ids: &Tensor, out: &Tensor) -> Result<()>;
    /// `out = x · wᵀ (+ bias)`: `x` `[m, k]` f32, `w` `[n, k]`, `bias` `[n]` f32, `out` `[m, n]` f32.
    fn linear(&self, x: &Tensor, w: &Tensor, bias: Option<&Tensor>, out: &Tensor) -> Result<()>;
    /// Several linears of one input (`out_i = x · w_iᵀ (+ bias_i)`), such as the Q, K
    /// and V projections; a backend may run them as one operation.
    fn linear_many(&self, x: &Tensor, layers: &[LinearRef<'_>]) -> Result<()> {
        for l in layers {
            self.linear(x, l.w, l.bias, l.out)?;
        }
        Ok(())
    }
    /// Row-wise RMSNorm: `out = x / rms(x) * w`. `out` may be `x` itself.
    fn rms_norm(&self, x: &Tensor, w: &Tensor, eps: f32, out: &Tensor) -> Result<()>;
    /// `residual += x; out = rms_norm(residual) * w` in one pass.
    fn add_rms_norm(
        &self,
        residual: &Tensor,
        x: &Tensor,
        w: &Tensor,
        eps: f32,
        out: &Tensor,
    ) -> Result<()>;
    /// Rotary embedding in place on `x` `[tokens, heads * head_dim]`, one position per token.
    /// `inv_freq` holds `rotary_dim / 2` f32 frequencies; dimensions past `rotary_dim` are untouched.
    fn rope(
        &self,
        x: &Tensor,
        positions: &Tensor,
        inv_freq: &Tensor,
        head_dim: usize,
        style: RopeStyle,
    ) -> Result<()>;
    /// `out = silu(gate) * up`, elementwise.
    fn silu_mul(&self, gate: &Tensor, up: &Tensor, out: &Tensor) -> Result<()>;
    /// `dst += src`, elementwise.
    fn add_assign(&self, dst: &Tensor, src: &Tensor) -> Result<()>;
    /// `out[i] = x[rows[i]]`: selects rows of an f32 `[m, d]` tensor; `rows` is u32.
    fn gather_rows(&self, x: &Tensor, rows: &Tensor, out: &Tensor) -> Result<()>;

    /// Per-head products: `out[:, h·k..(h+1)·k] = x[:, h·a..(h+1)·a] ·
    /// w[h·k..(h+1)·k]ᵀ` for each head `h` of `heads`, f32 `x` `[t,
    /// heads·a]` and `out` `[t, heads·k]`, a weight `w` `[heads·k, a]`
    /// (latent attention's up-projections). Batch-invariant as `linear`.
    /// This default gathers the heads' rows and runs one `linear` per head
    /// ([`crate::backend::columns::linear_heads_by_rows`]); a backend may run them
    /// as one batched product.
    fn linear_heads(&self, x: &Tensor, w: &Tensor, heads: usize, out: &Tensor) -> Result<()> {
        crate::backend::columns::linear_heads_by_rows(self, x, w, heads, out)
    }

    /// `out = [parts[0] | parts[1] | ...]`: f32 tensors of one row count
    /// joined side by side (their widths summing to `out`'s). This default
    /// copies them into one buffer and gathers its rows
    /// ([`crate::backend::columns::concat_cols_by_rows`]); a backend may write
    /// `out`'s column blocks in place.
    fn concat_cols(&self, parts: &[&Tensor], out: &Tensor) -> Result<()> {
        crate::backend::columns::concat_cols_by_rows(self, parts, out)
    }

    /// `out[rows[i]] += scales[i] * x[i]` for each row `i` of `x` (`[n, d]`
    /// f32), in order of `i` (so a row listed twice gets both additions, in
    /// that order); `rows` is u32 `[n]`, `scales` f32 `[n]`, `out` f32 `[m,
    /// d]`. The combine step of a mixture of experts. This default runs on
    /// the host (a download and a write of `out`); a backend may run it
    /// where the tensors are.
    fn scatter_add_rows(
        &self,
        out: &Tensor,
        rows: &Tensor,
        scales: &Tensor,
        x: &Tensor,
    ) -> Result<()> {
        let (n, d) = (x.rows(), x.row_len());
        if out.dtype() != DType::F32
            || x.dtype() != DType::F32
            || rows.dtype() != DType::U32
            || scales.dtype() != DType::F32
            || rows.numel() != n
            || scales.numel() != n
            || out.row_len() != d
        {
            return Err(CoreError::invalid(format!(
                "scatter-add {x:?} into {out:?} at {rows:?} scaled by {scales:?}"
            )));
        }
        let host = |t: &Tensor| -> Result<Vec<u8>> {
            let mut bytes = vec![0u8; t.byte_len()?];
            self.download(t, &mut bytes)?;
            Ok(bytes)
        };
        let word = |b: &[u8], i: usize| [b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]];
        let (ob, rb, sb, xb) = (host(out)?, host(rows)?, host(scales)?, host(x)?);
        let mut acc: Vec<f32> = (0..out.numel())
            .map(|i| f32::from_le_bytes(word(&ob, i)))
            .collect();
        for i in 0..n {
            let r = u32::from_le_bytes(word(&rb, i)) as usize;
            if r >= out.rows() {
                return Err(CoreError::invalid(format!(
                    "scatter-add row {r} past {} rows",
                    out.rows()
                )));
            }
            let s = f32::from_le_bytes(word(&sb, i));
            for j in 0..d {
                acc[r * d + j] += s * f32::from_le_bytes(word(&xb, i * d + j));
            }
        }
        let bytes: Vec<u8> = acc.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.write(out, &bytes)
    }

    /// LoRA: adds `(x[rows] aᵀ) bᵀ` to `out[rows]` for each entry (rows of
    /// entries do not overlap). Each row's sum depends on that row alone, so
    /// the result is batch-invariant. This default runs a shrink, an expand
    /// and an add per entry; a backend may fuse them into one pass.
    fn lora_add(&self, x: &Tensor, out: &Tensor, entries: &[LoraRows<'_>]) -> Result<()> {
        let t = x.rows();
        for e in entries {
            let n = e.rows.len();
            if n == 0 {
                continue;
            }
            if e.rows.end > t || out.rows() != t {
                return Err(CoreError::invalid(format!(
                    "LoRA rows {:?} outside a batch of {t} rows",
                    e.rows
                )));
            }
            let (xs, os) = if n == t {
                (x.clone(), out.clone())
            } else {
                (x.narrow(e.rows.start, n)?, out.narrow(e.rows.start, n)?)
            };
            let shrunk = self.alloc(DType::F32, &[n, e.a.rows()])?;
            self.linear(&xs, e.a, None, &shrunk)?;
            let delta = self.alloc(DType::F32, &[n, os.row_len()])?;
            self.linear(&shrunk, e.b, None, &delta)?;
            self.add_assign(&os, &delta)?;
        }
        Ok(())
    }

    /// One recurrent layer's token mixing (Gated DeltaNet) over a batch,
    /// reading and updating each sequence's state slot; see
    /// [`recurrent::GatedDeltaNet`]. This default runs on the host
    /// ([`recurrent::gated_delta_net_on_host`]); a backend may run the
    /// same per-token recurrence where the tensors are.
    fn gated_delta_net(&self, call: &recurrent::GatedDeltaNet<'_>) -> Result<()> {
        recurrent::gated_delta_net_on_host(self, call)
    }

    /// `out = x * sigmoid(gate)`, elementwise (gated attention's output
    /// gate). This default runs on the host.
    fn sigmoid_mul(&self, gate: &Tensor, x: &Tensor, out: &Tensor) -> Result<()> {
        recurrent::sigmoid_mul_on_host(self, gate, x, out)
    }

    /// Creates one of the attention implementations listed in the capabilities.
    fn create_attention(&self, name: &str) -> Result<Arc<dyn AttentionBackend>>;

    /// Picks one token per row of `logits` (`[rows.len(), vocab]` f32) into `out`
    /// (`[rows.len()]` u32): argmax for greedy rows, otherwise a draw determined by the
    /// row's seed after temperature, top-k, top-p and min-p filtering. Devices whose
    /// memory is not host memory sample on the device so that only the ids cross to the
    /// host. This default downloads the logits and runs [`StandardSampler`] with
    /// `SeqRng::new(seed)`.
    ///
    /// [`StandardSampler`]: crate::sampling::StandardSampler
    fn sample(&self, logits: &Tensor, rows: &[SampleRow], out: &Tensor) -> Result<()> {
        let vocab = logits.row_len();
        if logits.dtype() != DType::F32
            || logits.rows() != rows.len()
            || out.dtype() != DType::U32
            || out.numel() != rows.len()
        {
            return Err(CoreError::invalid(format!(
                "sample {} rows of {logits:?} into {out:?}",
                rows.len()
            )));
        }
        let values = f32_values(self, logits)?;
        let mut ids = Vec::with_capacity(rows.len() * 4);
        for (r, row) in rows.iter().enumerate() {
            let id = row.draw(&values[r * vocab..(r + 1) * vocab])?;
            ids.extend_from_slice(&id.to_le_bytes());
        }
        self.write(out, &ids)
    }

    /// Log-probability statistics of each row of `logits` (`[rows, vocab]`
    /// f32): `lse` (`[rows]` f32) gets the row's log-sum-exp, and `top_ids`
    /// (`[rows, top]` u32) and `top_logprobs` (`[rows, top]` f32) its `top`
    /// largest logits as (id, logit - lse): largest first, the lower id first
    /// among equal values (`top <= vocab` and `top <= MAX_TOP_LOGPROBS`).
    /// Devices compute them where the logits are, so that only these cross
    /// to the host. This default downloads the logits.
    fn logprob_stats(
        &self,
        logits: &Tensor,
        top: usize,
        lse: &Tensor,
        top_ids: &Tensor,
        top_logprobs: &Tensor,
    ) -> Result<()> {
        check_logprob_stats(logits, top, lse, top_ids, top_logprobs)?;
        let vocab = logits.row_len();
        let values = f32_values(self, logits)?;
        let (mut l, mut ids, mut vals) = (Vec::new(), Vec::new(), Vec::new());
        for row in values.chunks_exact(vocab.max(1)) {
            let m = crate::sampling::log_sum_exp(row);
            l.extend_from_slice(&m.to_le_bytes());
            for (id, x) in crate::sampling::top_logits(row, top) {
                ids.extend_from_slice(&id.to_le_bytes());
                vals.extend_from_slice(&(x - m).to_le_bytes());
            }
        }
        self.write(lse, &l)?;
        self.write(top_ids, &ids)?;
        self.write(top_logprobs, &vals)
    }

    /// The rank of `tokens[r]` in row `r` of `logits` (`[rows, vocab]` f32,
    /// `tokens.len() == rows`): one more than the number of the row's
    /// logits strictly greater than the token's, so 1 is the most likely (a
    /// token past the row ranks `vocab + 1`). vLLM reports it with prompt
    /// log-probabilities. This default downloads the logits.
    fn logit_ranks(&self, logits: &Tensor, tokens: &[u32]) -> Result<Vec<u32>> {
        let vocab = logits.row_len();
        if logits.rows() != tokens.len() {
            return Err(CoreError::invalid(format!(
                "ranks of {} tokens in {} rows",
                tokens.len(),
                logits.rows()
            )));
        }
        let values = f32_values(self, logits)?;
        Ok(values
            .chunks_exact(vocab.max(1))
            .zip(tokens)
            .map(|(row, &t)| match row.get(t as usize) {
                Some(&x) => 1 + row.iter().filter(|&&y| y > x).count() as u32,
                None => vocab as u32 + 1,
            })
            .collect())
    }

    /// Applies `edits` ([`crate::sampling::logit_edits`]) in place to `logits`
    /// (`[rows, vocab]` f32) before [`Backend::sample`], giving exactly the
    /// bits of [`LogitEdits::apply`] on the host. Devices whose memory is not
    /// host memory edit on the device so that only the edits cross. This
    /// default downloads the logits, edits them and writes them back.
    ///
    /// [`LogitEdits::apply`]: crate::sampling::logit_edits::LogitEdits::apply
    fn edit_logits(
        &self,
        logits: &Tensor,
        edits: &crate::sampling::logit_edits::LogitEdits,
    ) -> Result<()> {
        if logits.dtype() != DType::F32 {
            return Err(CoreError::invalid(format!("logit edits on {logits:?}")));
        }
        edits.check(logits.rows(), logits.row_len())?;
        if edits.is_empty() {
            return Ok(());
        }
        let mut values = f32_values(self, logits)?;
        edits.apply(&mut values, logits.row_len())?;
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.write(logits, &bytes)
    }
}

/// The values of an f32 tensor, downloaded (the host side of the defaults).
pub(crate) fn f32_values<B: Backend + ?Sized>(b: &B, t: &Tensor) -> Result<Vec<f32>> {
    t.check_dtype(DType::F32)?;
    let mut bytes = vec![0u8; t.byte_len()?];
    b.download(t, &mut bytes)?;
    Ok(bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

/// Most alternatives [`Backend::logprob_stats`] gives per row.
pub const MAX_TOP_LOGPROBS: usize = 64;

/// The argument check of [`Backend::logprob_stats`], for every backend.
pub fn check_logprob_stats(
    logits: &Tensor,
    top: usize,
    lse: &Tensor,
    top_ids: &Tensor,
    top_logprobs: &Tensor,
) -> Result<()> {
    let (rows, vocab) = (logits.rows(), logits.row_len());
    logits.check_dtype(DType::F32)?;
    lse.check_dtype(DType::F32)?;
    top_ids.check_dtype(DType::U32)?;
    top_logprobs.check_dtype(DType::F32)?;
    if top > vocab
        || top > MAX_TOP_LOGPROBS
        || lse.numel() != rows
        || top_ids.numel() != rows * top
        || top_logprobs.numel() != rows * top
    {
        return Err(CoreError::invalid(format!(
            "logprob statistics (top {top}) of {logits:?} into {lse:?}, {top_ids:?}, {top_logprobs:?}"
        )));
    }
    for out in [lse, top_ids, top_logprobs] {
        out.check_no_overlap(&[logits])?;
    }
    Ok(())
}

impl dyn Backend + '_ {
    /// Uploads f32 values as a tensor of `shape`.
    pub fn upload_f32(&self, shape: &[usize], values: &[f32]) -> Result<Tensor> {
        self.upload(&HostTensor::from_f32(shape, values))
    }

    /// Uploads u32 values as a tensor of `shape`.
    pub fn upload_u32(&self, shape: &[usize], values: &[u32]) -> Result<Tensor> {
        let data: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.upload(&HostTensor {
            dtype: DType::U32,
            shape: shape.to_vec(),
            data: std::borrow::Cow::Owned(data),
        })
    }

    /// Downloads an f32 tensor.
    pub fn download_f32(&self, t: &Tensor) -> Result<Vec<f32>> {
        f32_values(self, t)
    }

    /// Downloads a u32 tensor's values.
    pub fn download_u32(&self, t: &Tensor) -> Result<Vec<u32>> {
        t.check_dtype(DType::U32)?;
        let mut bytes = vec![0u8; t.byte_len()?];
        self.download(t, &mut bytes)?;
        Ok(bytes
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }

    /// Attention implementation by name, or the device's default when `None`.
    pub fn attention(&self, name: Option<&str>) -> Result<Arc<dyn AttentionBackend>> {
        let caps = self.capabilities();
        let name = match name {
            Some(n) => n,
            None => caps.attention.first().copied().ok_or_else(|| {
                CoreError::unsupported(format!("{} offers no attention backend", self.info().name))
            })?,
        };
        self.create_attention(name)
    }
}

#[cfg(test)]
mod tests {
    use super::HostRows;

    #[test]
    fn host_rows_pick_their_bytes_and_refuse_rows_past_the_data() {
        let data: Vec<u8> = (0..20).collect();
        let rows = HostRows::strided(&data[1..], 3, 5, 4).unwrap();
        assert_eq!(rows.len(), 12);
        assert_eq!(rows.to_vec(), [1, 2, 3, 6, 7, 8, 11, 12, 13, 16, 17, 18]);
        assert_eq!(rows.span(), &data[1..19]);
        assert_eq!(rows.contiguous(), None);
        let packed = HostRows::strided(&data, 4, 4, 3).unwrap();
        assert_eq!(packed.contiguous(), Some(&data[..12]));
        assert_eq!(HostRows::whole(&data).contiguous(), Some(&data[..]));
        assert!(HostRows::whole(&[]).is_empty());
        assert!(HostRows::strided(&data, 0, 0, 0).unwrap().is_empty());
        // The last row would end past the data; rows wider than their pitch overlap.
        assert!(HostRows::strided(&data[1..], 3, 5, 5).is_err());
        assert!(HostRows::strided(&data, 6, 5, 2).is_err());
        assert!(HostRows::strided(&data, 1, usize::MAX, 3).is_err());
    }
}
