//! LoRA adapters on the device and their application to a batch.
//!
//! A [`LoraAdapter`] holds, per layer and per [`LoraTarget`] linear, the two
//! low-rank factors of a PEFT adapter: `A` `[r, in]` and `B` `[out, r]`, both
//! f32, `B` already multiplied by the adapter's scaling (`alpha / r`, or
//! `alpha / sqrt(r)` with rsLoRA). A linear `y = x W^T` becomes
//! `y = x W^T + (x A^T) B^T`. Adapters are built by a loader (crates/lora)
//! and shared through `Arc`: a request holds its adapter until it finishes,
//! so unloading one never frees weights a running request reads.
//!
//! A batch applies adapters by *segments* ([`LoraSegment`]): contiguous rows
//! of the packed batch that use one adapter. The executor packs each
//! adapter's sequences next to one another, so a step costs one
//! [`Backend::lora_add`] per target linear (a segmented shrink and expand
//! over every adapter of the step), whatever the number of requests. Each row's delta is a product over that row alone
//! (the linear kernels are batch-invariant), so a request's output does not
//! depend on which adapters share its step.
//!
//! Invariants (checked by [`LoraAdapter::new`]): every factor pair has
//! `A.rows() == B.row_len() <= rank` (PEFT's `rank_pattern` gives modules
//! ranks of their own); the layer count matches the model the
//! loader checked it against; segments of a batch do not overlap.

use crate::backend::{Backend, LoraRows};
use crate::dtype::DType;
use crate::error::{CoreError, Result};
use crate::tensor::Tensor;
use std::ops::Range;
use std::sync::Arc;

/// The linear layers of a decoder layer an adapter may target, with their
/// PEFT module names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LoraTarget {
    /// `self_attn.q_proj`.
    Q,
    /// `self_attn.k_proj`.
    K,
    /// `self_attn.v_proj`.
    V,
    /// `self_attn.o_proj`.
    O,
    /// `mlp.gate_proj`.
    Gate,
    /// `mlp.up_proj`.
    Up,
    /// `mlp.down_proj`.
    Down,
}

impl LoraTarget {
    /// Every target, in layer order.
    pub const ALL: [LoraTarget; 7] = [
        LoraTarget::Q,
        LoraTarget::K,
        LoraTarget::V,
        LoraTarget::O,
        LoraTarget::Gate,
        LoraTarget::Up,
        LoraTarget::Down,
    ];

    /// The PEFT `target_modules` name (`q_proj`, ...).
    pub fn module(self) -> &'static str {
        match self {
            LoraTarget::Q => "q_proj",
            LoraTarget::K => "k_proj",
            LoraTarget::V => "v_proj",
            LoraTarget::O => "o_proj",
            LoraTarget::Gate => "gate_proj",
            LoraTarget::Up => "up_proj",
            LoraTarget::Down => "down_proj",
        }
    }

    /// The module's path inside a decoder layer (`self_attn.q_proj`, ...).
    pub fn path(self) -> &'static str {
        match self {
            LoraTarget::Q => "self_attn.q_proj",
            LoraTarget::K => "self_attn.k_proj",
            LoraTarget::V => "self_attn.v_proj",
            LoraTarget::O => "self_attn.o_proj",
            LoraTarget::Gate => "mlp.gate_proj",
            LoraTarget::Up => "mlp.up_proj",
            LoraTarget::Down => "mlp.down_proj",
        }
    }

    /// The target of a PEFT module name.
    pub fn from_module(name: &str) -> Option<LoraTarget> {
        LoraTarget::ALL.into_iter().find(|t| t.module() == name)
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// One linear's factors: `a` `[r, in]`, `b` `[out, r]` (scaled), and `b`
/// transposed (the layout a row-at-a-time expand reads contiguously).
#[derive(Clone, Debug)]
pub struct LoraPair {
    /// The shrink factor `[r, in]`.
    pub a: Tensor,
    /// The expand factor `[out, r]`, multiplied by the adapter's scaling.
    pub b: Tensor,
    /// `b` transposed, `[r, out]`.
    pub bt: Tensor,
}

/// The factors of one decoder layer, by target.
#[derive(Clone, Debug, Default)]
pub struct LoraLayer {
    pairs: [Option<LoraPair>; 7],
}

impl LoraLayer {
    /// Sets the factors of `target`.
    pub fn set(&mut self, target: LoraTarget, pair: LoraPair) {
        self.pairs[target.index()] = Some(pair);
    }

    /// The factors of `target`, when the adapter has them in this layer.
    pub fn get(&self, target: LoraTarget) -> Option<&LoraPair> {
        self.pairs[target.index()].as_ref()
    }
}

/// A loaded adapter (see the module doc).
pub struct LoraAdapter {
    name: String,
    digest: String,
    rank: usize,
    layers: Vec<LoraLayer>,
    bytes: u64,
    /// With tensor parallelism: rank `r`'s slices of the factors (then
    /// `layers` is empty; see [`LoraAdapter::sharded`]).
    shards: Vec<Arc<LoraAdapter>>,
    /// With data parallelism: one copy per replica, on its devices (then
    /// `layers` and `shards` are empty; see [`LoraAdapter::replicated`]).
    replicas: Vec<Arc<LoraAdapter>>,
    /// The device (backend tag, [`crate::tensor::BufferId::device`]) the
    /// factors in `layers` live on; `None` when `layers` holds none.
    device: Option<u32>,
}

impl std::fmt::Debug for LoraAdapter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoraAdapter")
            .field("name", &self.name)
            .field("rank", &self.rank)
            .field("layers", &self.layers.len())
            .finish()
    }
}

impl LoraAdapter {
    /// An adapter named `name` whose files hash to `digest`, of rank `rank`,
    /// with one entry per decoder layer (a layer may have no factors).
    pub fn new(name: &str, digest: &str, rank: usize, layers: Vec<LoraLayer>) -> Result<Self> {
        if rank == 0 {
            return Err(CoreError::invalid(format!("LoRA adapter '{name}': rank 0")));
        }
        let mut bytes = 0u64;
        for (i, l) in layers.iter().enumerate() {
            for (t, p) in LoraTarget::ALL.iter().zip(&l.pairs) {
                let Some(p) = p else { continue };
                let shapes_fit = [&p.a, &p.b, &p.bt]
                    .iter()
                    .all(|t| t.dtype() == DType::F32 && t.shape().len() == 2)
                    && p.a.rows() == p.b.row_len()
                    && p.bt.shape() == [p.b.row_len(), p.b.rows()]
                    && (1..=rank).contains(&p.a.rows());
                if !shapes_fit {
                    return Err(CoreError::invalid(format!(
                        "LoRA adapter '{name}': layer {i} {}: factors {:?} and {:?} are not f32 [r, in] and [out, r] with r <= {rank}",
                        t.module(),
                        p.a,
                        p.b
                    )));
                }
                bytes += (p.a.byte_len()? + p.b.byte_len()? + p.bt.byte_len()?) as u64;
            }
        }
        let device = layers
            .iter()
            .flat_map(|l| l.pairs.iter().flatten())
            .map(|p| p.a.buffer_id().device)
            .next();
        Ok(Self {
            name: name.to_string(),
            digest: digest.to_string(),
            rank,
            layers,
            bytes,
            shards: Vec::new(),
            replicas: Vec::new(),
            device,
        })
    }

    /// An adapter split over the ranks of a tensor-parallel group:
    /// `shards[r]` holds rank `r`'s slices, on its device (the output rows
    /// of column-parallel targets, the input columns of row-parallel ones;
    /// see `arbor_models::shard`). Requests hold this adapter; each rank's
    /// model applies its own shard ([`LoraAdapter::shard`]).
    pub fn sharded(name: &str, digest: &str, shards: Vec<LoraAdapter>) -> Result<Self> {
        if shards.len() < 2
            || shards
                .iter()
                .any(|s| !s.shards.is_empty() || !s.replicas.is_empty())
        {
            return Err(CoreError::invalid(format!(
                "LoRA adapter '{name}': a sharded adapter needs two or more unsharded shards"
            )));
        }
        let layers = shards[0].layers.len();
        if shards.iter().any(|s| s.layers.len() != layers) {
            return Err(CoreError::invalid(format!(
                "LoRA adapter '{name}': shards of different layer counts"
            )));
        }
        Ok(Self {
            name: name.to_string(),
            digest: digest.to_string(),
            rank: shards.iter().map(|s| s.rank).max().unwrap_or(0),
            layers: Vec::new(),
            bytes: shards.iter().map(|s| s.bytes).sum(),
            shards: shards.into_iter().map(Arc::new).collect(),
            replicas: Vec::new(),
            device: None,
        })
    }

    /// An adapter held once per data-parallel replica: `copies[d]` on
    /// replica `d`'s devices (each unsharded, or sharded over the replica's
    /// tensor-parallel ranks). Requests hold this adapter; each rank's model
    /// applies the copy on its own device ([`LoraAdapter::for_rank`]).
    pub fn replicated(name: &str, digest: &str, copies: Vec<LoraAdapter>) -> Result<Self> {
        if copies.len() < 2 || copies.iter().any(|c| !c.replicas.is_empty()) {
            return Err(CoreError::invalid(format!(
                "LoRA adapter '{name}': a replicated adapter needs two or more copies"
            )));
        }
        let layers = copies[0].num_layers();
        if copies
            .iter()
            .any(|c| c.num_layers() != layers || c.shards.len() != copies[0].shards.len())
        {
            return Err(CoreError::invalid(format!(
                "LoRA adapter '{name}': copies of different shapes"
            )));
        }
        Ok(Self {
            name: name.to_string(),
            digest: digest.to_string(),
            rank: copies.iter().map(|c| c.rank).max().unwrap_or(0),
            layers: Vec::new(),
            bytes: copies.iter().map(|c| c.bytes).sum(),
            shards: Vec::new(),
            replicas: copies.into_iter().map(Arc::new).collect(),
            device: None,
        })
    }

    /// Whether factors of this adapter (or of one of its shards) live on
    /// `device`.
    fn is_on(&self, device: u32) -> bool {
        self.device == Some(device) || self.shards.iter().any(|s| s.is_on(device))
    }

    /// What the model rank on `device` (a backend tag), rank `rank` of a
    /// tensor-parallel group of `world`, applies: the replica copy with
    /// factors on `device` when the adapter is replicated, then that copy's
    /// shard for the rank ([`LoraAdapter::shard`]).
    pub fn for_rank(
        self: &Arc<Self>,
        device: u32,
        rank: usize,
        world: usize,
    ) -> Result<Arc<LoraAdapter>> {
        if self.replicas.is_empty() {
            return self.shard(rank, world);
        }
        let copy = self
            .replicas
            .iter()
            .find(|c| c.is_on(device))
            .ok_or_else(|| {
                CoreError::invalid(format!(
                    "LoRA adapter '{}' has no copy on this rank's device",
                    self.name
                ))
            })?;
        copy.shard(rank, world)
    }

    /// What rank `rank` of a group of `world` applies: the adapter itself
    /// on one device, its shard in a group it was split for; an error
    /// otherwise (an adapter loaded for another group size).
    pub fn shard(self: &Arc<Self>, rank: usize, world: usize) -> Result<Arc<LoraAdapter>> {
        match self.shards.len() {
            0 if world == 1 => Ok(self.clone()),
            n if n == world && rank < n => Ok(self.shards[rank].clone()),
            n => Err(CoreError::invalid(format!(
                "LoRA adapter '{}' was loaded for {} rank(s); the model runs on {world}",
                self.name,
                n.max(1)
            ))),
        }
    }

    /// The name requests use.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// A digest of the adapter's files: its prefix-cache namespace, so that
    /// KV computed with one adapter is never reused by another (or by the
    /// base model), and an adapter reloaded from the same files finds its KV.
    pub fn digest(&self) -> &str {
        &self.digest
    }

    /// The rank (the largest of its factors).
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Decoder layers the adapter was built for.
    pub fn num_layers(&self) -> usize {
        self.shards
            .first()
            .or(self.replicas.first())
            .map_or(self.layers.len(), |s| s.num_layers())
    }

    /// Device bytes of the factors.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Targets with factors in at least one layer.
    pub fn targets(&self) -> Vec<LoraTarget> {
        if let Some(s) = self.shards.first().or(self.replicas.first()) {
            return s.targets();
        }
        LoraTarget::ALL
            .into_iter()
            .filter(|t| self.layers.iter().any(|l| l.get(*t).is_some()))
            .collect()
    }

    /// The factors of `target` in `layer` (none on a sharded adapter: its
    /// ranks read their [`LoraAdapter::shard`]).
    pub fn pair(&self, layer: usize, target: LoraTarget) -> Option<&LoraPair> {
        self.layers.get(layer).and_then(|l| l.get(target))
    }
}

/// Rows of a packed batch that use one adapter.
#[derive(Clone, Debug)]
pub struct LoraSegment {
    /// The adapter.
    pub adapter: Arc<LoraAdapter>,
    /// Packed rows (tokens) it applies to.
    pub rows: Range<usize>,
}

/// Adds the adapters' deltas of `target` in `layer` to `out` (`[t, out]`,
/// already holding `x W^T`) for the rows of each segment; `x` is `[t, in]`.
pub fn apply_lora(
    backend: &dyn Backend,
    segments: &[LoraSegment],
    layer: usize,
    target: LoraTarget,
    x: &Tensor,
    out: &Tensor,
) -> Result<()> {
    let entries: Vec<LoraRows<'_>> = segments
        .iter()
        .filter_map(|s| {
            s.adapter.pair(layer, target).map(|p| LoraRows {
                rows: s.rows.clone(),
                a: &p.a,
                b: &p.b,
                bt: &p.bt,
            })
        })
        .collect();
    if entries.is_empty() {
        return Ok(());
    }
    backend.lora_add(x, out, &entries)
}
