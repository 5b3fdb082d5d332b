//! What the draft heads (EAGLE3's [`Eagle3Head`](crate::Eagle3Head), EAGLE's
//! [`EagleHead`](crate::EagleHead), MTP's [`MtpHead`](crate::MtpHead))
//! share: reading a head's `config.json` (and the checks every head makes
//! of it and of its batches, hidden input and KV cache) and a head folder's
//! `model.safetensors` or `pytorch_model.bin` (every tensor's shape and dtype checked, errors
//! naming the tensor and the file), and the pieces of a Llama decoder layer
//! they run with [`Backend`] operations (rotary self-attention over one
//! layer of the caller's KV cache, the SwiGLU MLP, row selection, the LM
//! head), loaded from any [`Weights`].

use arbor_engine_core::{
    AttentionParams, Backend, CoreError, DType, ForwardBatch, ForwardContext, HostTensor, KvSpec,
    LinearRef, ModelSpec, Result, RopeStyle, Tensor,
};
use arbor_models::DecoderConfig;
use memmap2::Mmap;
use safetensors::SafeTensors;
use safetensors::tensor::{Dtype, SafeTensorError, TensorView};
use serde_json::Value;
use std::borrow::Cow;
use std::fs::File;
use std::path::{Path, PathBuf};

/// A config error naming the file and the key.
pub(crate) fn cfg_err(file: &str, key: &str, what: impl std::fmt::Display) -> CoreError {
    CoreError::Config(format!("{file}: key '{key}' {what}"))
}

/// The head's `config.json` in `dir`, parsed, with its path for errors.
pub(crate) fn read_config(dir: &Path) -> Result<(Value, String)> {
    let cfg_path = dir.join("config.json");
    let file = cfg_path.display().to_string();
    let text = std::fs::read_to_string(&cfg_path).map_err(|e| CoreError::io(&cfg_path, e))?;
    let v: Value = serde_json::from_str(&text)
        .map_err(|e| CoreError::load(format!("{file}: invalid JSON: {e}")))?;
    Ok((v, file))
}

/// Checks that the config's architecture is `expected`.
pub(crate) fn check_architecture(c: &DecoderConfig, file: &str, expected: &str) -> Result<()> {
    if c.architecture != expected {
        return Err(cfg_err(
            file,
            "architectures",
            format!("is '{}', expected '{expected}'", c.architecture),
        ));
    }
    Ok(())
}

/// Refuses what the heads do not run: `attention_bias` or `mlp_bias` set
/// (`biases` says why) and a sliding window (`window` says why).
pub(crate) fn check_plain_llama(
    v: &Value,
    c: &DecoderConfig,
    file: &str,
    biases: &str,
    window: &str,
) -> Result<()> {
    for key in ["attention_bias", "mlp_bias"] {
        if v.get(key).and_then(Value::as_bool) == Some(true) {
            return Err(cfg_err(file, key, biases));
        }
    }
    if c.sliding_window.is_some() {
        return Err(cfg_err(file, "sliding_window", window));
    }
    Ok(())
}

/// The boolean `key` of `v`, `default` when absent or null.
pub(crate) fn read_bool(v: &Value, file: &str, key: &str, default: bool) -> Result<bool> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(x) => x
            .as_bool()
            .ok_or_else(|| cfg_err(file, key, format!("must be true or false, found {x}"))),
    }
}

/// Checks that the head's vocabulary is the target's.
pub(crate) fn check_vocab(c: &DecoderConfig, target: &ModelSpec, file: &str) -> Result<()> {
    if c.vocab_size != target.vocab_size {
        return Err(cfg_err(
            file,
            "vocab_size",
            format!(
                "is {}, but the target's vocabulary has {} ids",
                c.vocab_size, target.vocab_size
            ),
        ));
    }
    Ok(())
}

/// The target id of a draft id when the head's logits cover the target's
/// vocabulary of `vocab` ids (the same id).
pub(crate) fn same_id(draft_id: u32, vocab: usize) -> Result<u32> {
    if (draft_id as usize) < vocab {
        Ok(draft_id)
    } else {
        Err(CoreError::invalid(format!(
            "draft id {draft_id} outside the vocabulary of {vocab}"
        )))
    }
}

/// A head's KV cache shape: `layers` layers of its geometry.
pub(crate) fn kv_spec(
    c: &DecoderConfig,
    layers: usize,
    page_size: usize,
    num_pages: usize,
    dtype: DType,
) -> KvSpec {
    KvSpec {
        num_layers: layers,
        num_kv_heads: c.num_key_value_heads,
        head_dim: c.head_dim,
        page_size,
        num_pages,
        dtype,
        values_in_keys: false,
    }
}

/// The rotary inverse frequencies of `c`, uploaded.
pub(crate) fn upload_inv_freq(b: &(dyn Backend + 'static), c: &DecoderConfig) -> Result<Tensor> {
    let freqs = c.inv_freq();
    b.upload_f32(&[freqs.len()], &freqs)
}

/// Checks a draft forward's batch: valid for `vocab`, and without
/// `hidden_layers`, `exit_after` or LoRA (`what` names the head).
pub(crate) fn check_batch(batch: &ForwardBatch, vocab: usize, what: &str) -> Result<()> {
    batch.validate(vocab)?;
    if !batch.hidden_layers.is_empty() || batch.exit_after.is_some() || !batch.lora.is_empty() {
        return Err(CoreError::invalid(format!(
            "an {what} draft forward takes no hidden_layers, exit_after or LoRA"
        )));
    }
    Ok(())
}

/// Checks that `hidden` is f32 `[t, h]` (`what` names the head).
pub(crate) fn check_hidden(hidden: &Tensor, t: usize, h: usize, what: &str) -> Result<()> {
    if hidden.dtype() != DType::F32 || hidden.shape() != [t, h] {
        return Err(CoreError::invalid(format!(
            "{what} hidden {hidden:?} for {t} tokens: expected f32 [{t}, {h}]"
        )));
    }
    Ok(())
}

/// Where a head's weights come from (its own `model.safetensors`, or the
/// target's checkpoint for MTP), with errors that name the tensor.
pub(crate) trait Weights {
    /// A required weight matrix of `shape`, uploaded (see [`upload_weight`]).
    fn weight(&self, b: &dyn Backend, name: &str, shape: &[usize]) -> Result<Tensor>;
    /// A required vector (norm weight, bias) of `len`, uploaded as f32.
    fn vector(&self, b: &dyn Backend, name: &str, len: usize) -> Result<Tensor>;
}

/// The two column halves of a weight `[out, 2h]` that reads a concatenation
/// `[a, b]`: columns `..h` read `a` (the embedding), columns `h..` read `b`
/// (the hidden state), so `W · [a, b] = W_embed · a + W_hidden · b`.
pub(crate) struct SplitLinear {
    pub(crate) embed: Tensor,
    pub(crate) hidden: Tensor,
}

impl SplitLinear {
    /// `t` (`[out, 2h]`, the weight `name`) split into its halves and uploaded.
    pub(crate) fn upload(
        b: &dyn Backend,
        t: &HostTensor<'_>,
        name: &str,
        h: usize,
    ) -> Result<Self> {
        let (e, hh) = split_columns(t, h)?;
        Ok(Self {
            embed: upload_weight(b, &e, name)?,
            hidden: upload_weight(b, &hh, name)?,
        })
    }
}

/// The head's `model.safetensors`, mapped, or its `pytorch_model.bin`
/// converted to safetensors bytes (as the published EAGLE heads ship).
pub(crate) struct HeadMap {
    bytes: HeadBytes,
    path: PathBuf,
}

enum HeadBytes {
    Mapped(Mmap),
    Converted(Vec<u8>),
}

impl HeadMap {
    /// Maps `dir/model.safetensors`, else reads `dir/pytorch_model.bin`.
    pub(crate) fn open(dir: &Path) -> Result<Self> {
        let path: PathBuf = dir.join("model.safetensors");
        let bin = dir.join("pytorch_model.bin");
        if !path.exists() && bin.exists() {
            let bytes = arbor_models::torch_bin::to_safetensors(&bin)?;
            return Ok(Self {
                bytes: HeadBytes::Converted(bytes),
                path: bin,
            });
        }
        let f = File::open(&path).map_err(|e| CoreError::io(&path, e))?;
        // SAFETY: the map is read-only and only read while loading; checkpoints
        // are not modified while loaded (as for every checkpoint Arbor maps).
        #[allow(unsafe_code)]
        let map = unsafe { Mmap::map(&f) }.map_err(|e| CoreError::io(&path, e))?;
        Ok(Self {
            bytes: HeadBytes::Mapped(map),
            path,
        })
    }

    /// Its tensors, read in place.
    pub(crate) fn file(&self) -> Result<HeadFile<'_>> {
        let bytes = match &self.bytes {
            HeadBytes::Mapped(m) => &m[..],
            HeadBytes::Converted(v) => &v[..],
        };
        let st = SafeTensors::deserialize(bytes).map_err(|e| {
            CoreError::load(format!(
                "{}: invalid safetensors file: {e}",
                self.path.display()
            ))
        })?;
        Ok(HeadFile {
            st,
            path: &self.path,
        })
    }
}

/// The head's tensors (safetensors bytes), read in place.
pub(crate) struct HeadFile<'a> {
    st: SafeTensors<'a>,
    pub(crate) path: &'a Path,
}

fn float_dtype(d: Dtype) -> Option<DType> {
    match d {
        Dtype::F32 => Some(DType::F32),
        Dtype::F16 => Some(DType::F16),
        Dtype::BF16 => Some(DType::BF16),
        _ => None,
    }
}

impl<'a> HeadFile<'a> {
    /// A load error naming the file and the tensor.
    pub(crate) fn err(&self, name: &str, what: impl std::fmt::Display) -> CoreError {
        CoreError::load(format!("{}: tensor '{name}' {what}", self.path.display()))
    }

    /// The tensor, `None` when absent.
    pub(crate) fn view(&self, name: &str) -> Result<Option<TensorView<'a>>> {
        match self.st.tensor(name) {
            Ok(t) => Ok(Some(t)),
            Err(SafeTensorError::TensorNotFound(_)) => Ok(None),
            Err(e) => Err(self.err(name, format!("cannot be read: {e}"))),
        }
    }

    /// The tensor when present, which must then have `shape`.
    pub(crate) fn view_shaped(
        &self,
        name: &str,
        shape: &[usize],
    ) -> Result<Option<TensorView<'a>>> {
        let Some(t) = self.view(name)? else {
            return Ok(None);
        };
        if t.shape() != shape {
            return Err(self.err(
                name,
                format!("has shape {:?}, expected {shape:?}", t.shape()),
            ));
        }
        Ok(Some(t))
    }

    /// The tensor, which must be present with `shape`.
    pub(crate) fn required(&self, name: &str, shape: &[usize]) -> Result<TensorView<'a>> {
        self.view_shaped(name, shape)?
            .ok_or_else(|| self.err(name, "is missing"))
    }

    /// A float tensor as a host tensor of its own dtype.
    pub(crate) fn host(&self, name: &str, t: &TensorView<'a>) -> Result<HostTensor<'a>> {
        let dtype = float_dtype(t.dtype()).ok_or_else(|| {
            self.err(
                name,
                format!("has dtype {:?}; supported: F32, F16, BF16", t.dtype()),
            )
        })?;
        let h = HostTensor {
            dtype,
            shape: t.shape().to_vec(),
            data: Cow::Borrowed(t.data()),
        };
        h.validate(name)?;
        Ok(h)
    }

    /// The weight `name` read as `t`, uploaded (see [`upload_weight`]).
    pub(crate) fn upload(&self, b: &dyn Backend, name: &str, t: &TensorView<'a>) -> Result<Tensor> {
        upload_weight(b, &self.host(name, t)?, name)
    }

    /// A required weight matrix of `shape`, uploaded (see [`upload_weight`]).
    pub(crate) fn weight(&self, b: &dyn Backend, name: &str, shape: &[usize]) -> Result<Tensor> {
        let t = self.required(name, shape)?;
        self.upload(b, name, &t)
    }

    /// A required vector (norm weight, bias) of `len`, uploaded as f32.
    pub(crate) fn vector(&self, b: &dyn Backend, name: &str, len: usize) -> Result<Tensor> {
        let t = self.required(name, &[len])?;
        let host = self.host(name, &t)?;
        let f = host.cast(DType::F32).map_err(|e| self.err(name, e))?;
        b.upload(&f)
    }

    /// A required `[out, 2h]` weight, uploaded as its two column halves.
    pub(crate) fn split(
        &self,
        b: &dyn Backend,
        name: &str,
        out: usize,
        h: usize,
    ) -> Result<SplitLinear> {
        let t = self.required(name, &[out, 2 * h])?;
        SplitLinear::upload(b, &self.host(name, &t)?, name, h)
    }
}

impl Weights for HeadFile<'_> {
    fn weight(&self, b: &dyn Backend, name: &str, shape: &[usize]) -> Result<Tensor> {
        HeadFile::weight(self, b, name, shape)
    }
    fn vector(&self, b: &dyn Backend, name: &str, len: usize) -> Result<Tensor> {
        HeadFile::vector(self, b, name, len)
    }
}

/// Uploads a weight matrix in its own dtype when the backend takes it, else as f32.
pub(crate) fn upload_weight(
    backend: &dyn Backend,
    t: &HostTensor<'_>,
    name: &str,
) -> Result<Tensor> {
    if backend.capabilities().weight_dtypes.contains(&t.dtype) {
        backend.upload(t)
    } else {
        let f = t
            .cast(DType::F32)
            .map_err(|e| CoreError::load(format!("tensor '{name}': {e}")))?;
        backend.upload(&f)
    }
}

/// Splits `[out, 2h]` row-major into its column halves `[out, h]` and `[out, h]`.
pub(crate) fn split_columns(
    t: &HostTensor<'_>,
    h: usize,
) -> Result<(HostTensor<'static>, HostTensor<'static>)> {
    let out = t.shape.first().copied().unwrap_or(0);
    let half = t.dtype.bytes_for(h)?;
    let mut a = Vec::with_capacity(out * half);
    let mut b = Vec::with_capacity(out * half);
    for row in t.data.chunks_exact(2 * half) {
        a.extend_from_slice(&row[..half]);
        b.extend_from_slice(&row[half..]);
    }
    let mk = |data: Vec<u8>| HostTensor {
        dtype: t.dtype,
        shape: vec![out, h],
        data: Cow::Owned(data),
    };
    Ok((mk(a), mk(b)))
}

/// A bias-free linear of [`Backend::linear_many`].
pub(crate) fn lin<'a>(w: &'a Tensor, out: &'a Tensor) -> LinearRef<'a> {
    LinearRef::new(w, None, out)
}

// ---------------------------------------------------------------------------
// Pieces of a Llama decoder layer.

/// Rotates `q` and `k` (neox style) at `pos` and attends over layer `layer`
/// of `ctx.kv` (writing K and V there); returns f32 `[t, heads * head_dim]`
/// before `o_proj`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn rope_attention(
    b: &dyn Backend,
    ctx: &ForwardContext<'_>,
    layer: usize,
    c: &DecoderConfig,
    inv_freq: &Tensor,
    pos: &Tensor,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
) -> Result<Tensor> {
    let (nh, nkv, hd) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
    b.rope(q, pos, inv_freq, hd, RopeStyle::Neox)?;
    b.rope(k, pos, inv_freq, hd, RopeStyle::Neox)?;
    let attn = b.alloc(DType::F32, &[q.rows(), nh * hd])?;
    let params = AttentionParams {
        num_heads: nh,
        num_kv_heads: nkv,
        head_dim: hd,
        scale: 1.0 / (hd as f32).sqrt(),
        sliding_window: None,
        kv_scales: arbor_engine_core::KvScales::ONE,
    };
    ctx.attention.forward(
        ctx.attention_batch,
        ctx.kv.layer(layer)?,
        q,
        k,
        v,
        &attn,
        &params,
    )?;
    Ok(attn)
}

/// Llama self-attention weights (no biases).
pub(crate) struct Attention {
    pub(crate) q: Tensor,
    pub(crate) k: Tensor,
    pub(crate) v: Tensor,
    pub(crate) o: Tensor,
}

impl Attention {
    /// Loads `{prefix}.{q,k,v,o}_proj.weight` for the geometry of `c`.
    pub(crate) fn load(
        src: &dyn Weights,
        b: &dyn Backend,
        prefix: &str,
        c: &DecoderConfig,
    ) -> Result<Self> {
        let (h, nh, nkv, hd) = (
            c.hidden_size,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
        );
        Ok(Self {
            q: src.weight(b, &format!("{prefix}.q_proj.weight"), &[nh * hd, h])?,
            k: src.weight(b, &format!("{prefix}.k_proj.weight"), &[nkv * hd, h])?,
            v: src.weight(b, &format!("{prefix}.v_proj.weight"), &[nkv * hd, h])?,
            o: src.weight(b, &format!("{prefix}.o_proj.weight"), &[h, nh * hd])?,
        })
    }

    /// `out = o_proj(attention(q(x), k(x), v(x)))` with [`rope_attention`]
    /// over layer `layer` of `ctx.kv`; `x` and `out` f32 `[t, h]`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn forward(
        &self,
        b: &dyn Backend,
        ctx: &ForwardContext<'_>,
        layer: usize,
        c: &DecoderConfig,
        inv_freq: &Tensor,
        pos: &Tensor,
        x: &Tensor,
        out: &Tensor,
    ) -> Result<()> {
        let (nh, nkv, hd) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        let t = x.rows();
        let q = b.alloc(DType::F32, &[t, nh * hd])?;
        let k = b.alloc(DType::F32, &[t, nkv * hd])?;
        let v = b.alloc(DType::F32, &[t, nkv * hd])?;
        b.linear_many(x, &[lin(&self.q, &q), lin(&self.k, &k), lin(&self.v, &v)])?;
        let attn = rope_attention(b, ctx, layer, c, inv_freq, pos, &q, &k, &v)?;
        b.linear(&attn, &self.o, None, out)
    }
}

/// Checks that `ctx`'s KV cache has `layers` layers of the head's geometry.
pub(crate) fn check_kv(
    ctx: &ForwardContext<'_>,
    c: &DecoderConfig,
    layers: usize,
    what: &str,
) -> Result<()> {
    let s = ctx.kv.spec();
    let (nkv, hd) = (c.num_key_value_heads, c.head_dim);
    if s.num_layers < layers || s.num_kv_heads != nkv || s.head_dim != hd {
        return Err(CoreError::invalid(format!(
            "KV cache {s:?} does not fit the {what} head ({layers} layers of {nkv} KV heads of {hd})"
        )));
    }
    Ok(())
}

/// A SwiGLU MLP: `down(silu(gate(x)) * up(x))`.
pub(crate) struct Mlp {
    pub(crate) gate: Tensor,
    pub(crate) up: Tensor,
    pub(crate) down: Tensor,
}

impl Mlp {
    /// Loads `{prefix}.{gate,up,down}_proj.weight` for hidden `h`, intermediate `inter`.
    pub(crate) fn load(
        src: &dyn Weights,
        b: &dyn Backend,
        prefix: &str,
        h: usize,
        inter: usize,
    ) -> Result<Self> {
        Ok(Self {
            gate: src.weight(b, &format!("{prefix}.gate_proj.weight"), &[inter, h])?,
            up: src.weight(b, &format!("{prefix}.up_proj.weight"), &[inter, h])?,
            down: src.weight(b, &format!("{prefix}.down_proj.weight"), &[h, inter])?,
        })
    }

    /// `out = mlp(x)`; `x` and `out` f32 `[t, h]`.
    pub(crate) fn forward(&self, b: &dyn Backend, x: &Tensor, out: &Tensor) -> Result<()> {
        let inter = self.gate.rows();
        let t = x.rows();
        let gate = b.alloc(DType::F32, &[t, inter])?;
        let up = b.alloc(DType::F32, &[t, inter])?;
        b.linear_many(x, &[lin(&self.gate, &gate), lin(&self.up, &up)])?;
        let act = b.alloc(DType::F32, &[t, inter])?;
        b.silu_mul(&gate, &up, &act)?;
        b.linear(&act, &self.down, None, out)
    }
}

/// The rows `rows` of f32 `x` (`[t, d]`); `x` itself when they are all rows in order.
pub(crate) fn select_rows(b: &(dyn Backend + 'static), x: Tensor, rows: &[u32]) -> Result<Tensor> {
    let t = x.rows();
    if rows.len() == t && rows.iter().enumerate().all(|(i, &r)| r as usize == i) {
        return Ok(x);
    }
    let out = b.alloc(DType::F32, &[rows.len(), x.row_len()])?;
    if !rows.is_empty() {
        let idx = b.upload_u32(&[rows.len()], rows)?;
        b.gather_rows(&x, &idx, &out)?;
    }
    Ok(out)
}

/// Logits `head · x` of f32 `x` (`[rows, h]`): f32 `[rows, vocab]`.
pub(crate) fn lm_logits(
    b: &dyn Backend,
    x: &Tensor,
    head: &Tensor,
    vocab: usize,
) -> Result<Tensor> {
    let rows = x.rows();
    let logits = b.alloc(DType::F32, &[rows, vocab])?;
    if rows > 0 {
        b.linear(x, head, None, &logits)?;
    }
    Ok(logits)
}
