//! The checkpoint loader the model architectures share: it reads each
//! tensor from a [`WeightSource`], checks its shape against the one the
//! config implies (errors name the tensor and the checkpoint), converts
//! or quantizes it through the load options' method, uploads it to the
//! backend, and counts progress and uploaded bytes.

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
    /// Linears loaded with a static input scale (W8A8 FP8).
    pub(crate) static_input_scales: usize,
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
        }
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

    /// A weight computed at load (an absorbed MLA projection) from f32
    /// values, stored in `dtype` then as the quantization method decides.
    pub(crate) fn absorbed(
        &mut self,
        what: &str,
        shape: &[usize],
        values: &[f32],
        dtype: DType,
    ) -> Result<Tensor> {
        let t = HostTensor::from_f32(shape, values).cast(dtype)?;
        let caps = self.opts.backend.capabilities().clone();
        let t = self
            .opts
            .quant
            .prepare(t, &caps)
            .map_err(|e| CoreError::load(format!("{}: {what}: {e}", self.src.describe())))?;
        let d = self.opts.backend.upload(&t)?;
        self.bytes += d.byte_len()? as u64;
        Ok(d)
    }

    /// Downloads a small f32 tensor loaded here (a router bias).
    pub(crate) fn download_f32(&self, t: &Tensor) -> Result<Vec<f32>> {
        self.opts.backend.download_f32(t)
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
    /// quantized tensors), stored as the quantization method decides.
    pub(crate) fn matrix(&mut self, prefix: &str, out: usize, inp: usize) -> Result<Tensor> {
        let caps = self.opts.backend.capabilities().clone();
        let spec = LinearSpec {
            prefix,
            out_features: out,
            in_features: inp,
        };
        let t = self.opts.quant.load_linear(self.src, &spec, &caps)?;
        self.upload(t)
    }
}
