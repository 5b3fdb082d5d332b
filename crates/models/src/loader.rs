//! The checkpoint loader the model architectures share: it reads each
//! tensor from a [`WeightSource`], checks its shape against the one the
//! config implies (errors name the tensor and the checkpoint), converts
//! or quantizes it through the load options' method, uploads it to the
//! backend, and counts progress and uploaded bytes.

use crate::shard::ShardedSource;
use arbor_engine_core::quant::cast_float_weight;
use arbor_engine_core::{
    CoreError, DType, HostTensor, LinearSpec, LoadOptions, Result, Tensor, WeightSource,
};

/// Reads, checks and uploads a checkpoint's tensors, counting progress.
pub(crate) struct Loader<'a> {
    pub(crate) src: &'a dyn WeightSource,
    pub(crate) opts: &'a LoadOptions,
    loaded: usize,
    total: usize,
    /// Bytes uploaded so far.
    pub(crate) bytes: u64,
    /// Linears loaded with a static input scale they apply (W8A8 FP8).
    pub(crate) static_input_scales: usize,
    /// A tensor-parallel rank's source, for the layers it loads whole and
    /// cuts after conversion (pre-quantized checkpoints).
    shard: Option<&'a ShardedSource<'a>>,
}

impl<'a> Loader<'a> {
    /// A loader of `total` tensors from `src`.
    pub(crate) fn new(src: &'a dyn WeightSource, opts: &'a LoadOptions, total: usize) -> Self {
        Self {
            src,
            opts,
            loaded: 0,
            total,
            bytes: 0,
            static_input_scales: 0,
            shard: None,
        }
    }

    /// A loader of rank `shard`'s slices (`src` is `shard` itself).
    pub(crate) fn with_shard(self, shard: Option<&'a ShardedSource<'a>>) -> Self {
        Self { shard, ..self }
    }

    /// The stored weight of the linear layer `prefix` (this rank's
    /// `out` x `inp` share), as the method loads it, and its static input
    /// scale if it has one (W8A8 FP8). A rank of a pre-quantized checkpoint
    /// loads the whole layer and keeps its share of the stored form.
    pub(crate) fn linear_weight(
        &mut self,
        prefix: &str,
        out: usize,
        inp: usize,
    ) -> Result<(HostTensor<'a>, Option<f32>)> {
        let caps = self.opts.backend.capabilities().clone();
        // Float methods (float and GGUF checkpoints) take what the source
        // cuts; the others may read a pre-quantized checkpoint.
        let share = match self.shard {
            Some(s) if !self.opts.quant.is_float() => {
                s.stored_share(prefix)?.map(|share| (s, share))
            }
            _ => None,
        };
        let (src, (out_features, in_features)) = match share {
            Some((s, share)) => (s.whole(), share.whole_shape(out, inp)),
            None => (self.src, (out, inp)),
        };
        let spec = LinearSpec {
            prefix,
            out_features,
            in_features,
        };
        let t = self.opts.quant.load_linear(src, &spec, &caps)?;
        let input_scale = match t.dtype {
            DType::F8A8_S32 => self.opts.quant.input_scale(src, &spec)?,
            _ => None,
        };
        let t = match share {
            Some((s, share)) => s.share_of(prefix, t, share)?,
            None => t,
        };
        Ok((t, input_scale))
    }

    fn fetch(&self, name: &str, shape: &[usize]) -> Result<Option<HostTensor<'a>>> {
        let src: &'a dyn WeightSource = self.src;
        let Some(t) = src.tensor(name)? else {
            return Ok(None);
        };
        if t.shape != shape {
            return Err(CoreError::load(format!(
                "{}: tensor '{name}' has shape {:?}, expected {shape:?}",
                self.src.describe(),
                t.shape
            )));
        }
        t.validate(name)?;
        Ok(Some(t))
    }

    fn missing(&self, name: &str) -> CoreError {
        CoreError::load(format!(
            "{}: tensor '{name}' is missing",
            self.src.describe()
        ))
    }

    /// The checkpoint being read.
    pub(crate) fn source(&self) -> &'a dyn WeightSource {
        self.src
    }

    /// A float weight computed at load (latent attention's per-head
    /// up-projections) from f32 values, stored in `dtype`, or in the dtype
    /// a float method casts to; under the other methods it stays float (as
    /// vLLM keeps `W_UK` and `W_UV` in the activations' dtype).
    pub(crate) fn up_projection(
        &mut self,
        what: &str,
        shape: &[usize],
        values: &[f32],
        dtype: DType,
    ) -> Result<Tensor> {
        let t = HostTensor::from_f32(shape, values).cast(dtype)?;
        let caps = self.opts.backend.capabilities().clone();
        let t = if self.opts.quant.is_float() {
            self.opts.quant.prepare(t, &caps)
        } else {
            cast_float_weight(t, None, &caps)
        }
        .map_err(|e| CoreError::load(format!("{}: {what}: {e}", self.src.describe())))?;
        let d = self.opts.backend.upload(&t)?;
        self.bytes += d.byte_len()? as u64;
        Ok(d)
    }

    /// Downloads a small f32 tensor loaded here (a router bias).
    pub(crate) fn download_f32(&self, t: &Tensor) -> Result<Vec<f32>> {
        self.opts.backend.download_f32(t)
    }

    /// The [`arbor_engine_core::ModelSpec::quantization`] of what was
    /// loaded: the method's name, and how many W8A8 layers round their
    /// inputs with a static scale.
    pub(crate) fn quantization_label(&self) -> String {
        match self.static_input_scales {
            0 => self.opts.quant.name().to_string(),
            n => format!(
                "{}, {n} layers with static input scales",
                self.opts.quant.name()
            ),
        }
    }

    /// Counts `n` tensors another rank loads.
    pub(crate) fn skip(&mut self, n: usize) {
        for _ in 0..n {
            self.tick();
        }
    }

    pub(crate) fn tick(&mut self) {
        self.loaded += 1;
        if let Some(p) = &self.opts.progress {
            p(self.loaded, self.total);
        }
    }

    pub(crate) fn upload(&mut self, t: HostTensor<'_>) -> Result<Tensor> {
        let d = self.opts.backend.upload(&t)?;
        self.bytes += d.byte_len()? as u64;
        self.tick();
        Ok(d)
    }

    /// A weight matrix, stored as the quantization method decides.
    pub(crate) fn weight(&mut self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let t = self.fetch(name, shape)?.ok_or_else(|| self.missing(name))?;
        let caps = self.opts.backend.capabilities().clone();
        let t = self.opts.quant.prepare(t, &caps).map_err(|e| {
            CoreError::load(format!("{}: tensor '{name}': {e}", self.src.describe()))
        })?;
        self.upload(t)
    }

    /// A vector kept in f32 (norm weights, biases).
    pub(crate) fn vector(&mut self, name: &str, len: usize) -> Result<Option<Tensor>> {
        let Some(t) = self.fetch(name, &[len])? else {
            return Ok(None);
        };
        let t = t.cast(DType::F32).map_err(|e| {
            CoreError::load(format!("{}: tensor '{name}': {e}", self.src.describe()))
        })?;
        self.upload(t).map(Some)
    }

    pub(crate) fn vector_req(&mut self, name: &str, len: usize) -> Result<Tensor> {
        self.vector(name, len)?.ok_or_else(|| self.missing(name))
    }

    /// A matrix kept in f32 whatever the quantization (MoE router weights).
    pub(crate) fn f32_matrix(&mut self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let t = self.fetch(name, shape)?.ok_or_else(|| self.missing(name))?;
        let t = t.cast(DType::F32).map_err(|e| {
            CoreError::load(format!("{}: tensor '{name}': {e}", self.src.describe()))
        })?;
        self.upload(t)
    }

    /// The weight of a linear without bias (`{prefix}.weight`, or its
    /// quantized tensors), stored as the quantization method decides, and
    /// the static input scale it applies (W8A8 FP8 over a checkpoint that
    /// has one; MoE experts, latent attention's `q_a_proj`).
    pub(crate) fn scaled_matrix(
        &mut self,
        prefix: &str,
        out: usize,
        inp: usize,
    ) -> Result<(Tensor, Option<f32>)> {
        let (t, input_scale) = self.linear_weight(prefix, out, inp)?;
        self.static_input_scales += usize::from(input_scale.is_some());
        Ok((self.upload(t)?, input_scale))
    }

    /// The static input scale the method reads for the whole linear
    /// `prefix` (`out` x `inp`) without loading it: another rank's expert,
    /// whose scale its block shares. Ask only where the layers loaded
    /// beside it are W8A8 FP8.
    pub(crate) fn input_scale_of(
        &self,
        prefix: &str,
        out: usize,
        inp: usize,
    ) -> Result<Option<f32>> {
        let spec = LinearSpec {
            prefix,
            out_features: out,
            in_features: inp,
        };
        let src = self.shard.map_or(self.src, |s| s.whole());
        self.opts.quant.input_scale(src, &spec)
    }
}
