//! The recurrence of a Gated DeltaNet (linear attention) layer, as the
//! device runs it: the state's shape ([`StateSpec`]) and per-layer storage
//! ([`StateLayer`]), the call a backend serves ([`GatedDeltaNet`],
//! [`crate::backend::Backend::gated_delta_net`]), the one reference kernel
//! ([`gated_delta_group`]) and the host defaults every backend may use.
//! The slots that hold the state are the cache's (`crate::kv::state`).
//!
//! Invariant (lossless by construction): [`gated_delta_group`] updates a
//! sequence's state one token at a time, each token with the same sequence
//! of operations whatever the step's shape, so the state after token `t`
//! is bit-identical whether the tokens before it came in one prefill, in
//! chunks of any size, alone or in a batch. A sequence whose batch starts
//! at position 0 (`fresh`) starts from zero state, whatever the slot held.

use crate::backend::{Backend, f32_values};
use crate::dtype::DType;
use crate::error::{CoreError, Result};
use crate::tensor::Tensor;
use std::ops::Range;

/// The shape of a model's recurrent state, declared once by the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StateSpec {
    /// Recurrent (Gated DeltaNet) layers.
    pub layers: usize,
    /// Channels of the causal convolution (`2 * k_heads * k_dim + v_heads * v_dim`).
    pub conv_channels: usize,
    /// Width of the convolution kernel (`linear_conv_kernel_dim`).
    pub conv_kernel: usize,
    /// Query/key heads.
    pub k_heads: usize,
    /// Value heads (a multiple of `k_heads`).
    pub v_heads: usize,
    /// Width of a query/key head.
    pub k_dim: usize,
    /// Width of a value head.
    pub v_dim: usize,
}

impl StateSpec {
    /// Checks the spec's arithmetic.
    pub fn validate(&self) -> Result<()> {
        let ok = self.layers > 0
            && self.conv_kernel >= 2
            && self.k_heads > 0
            && self.v_heads.is_multiple_of(self.k_heads)
            && self.k_dim > 0
            && self.v_dim > 0
            && self.conv_channels == 2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim;
        if ok {
            Ok(())
        } else {
            Err(CoreError::invalid(format!(
                "recurrent state {self:?} is inconsistent"
            )))
        }
    }
    /// Values in one slot's convolution state of one layer.
    pub fn conv_len(&self) -> usize {
        self.conv_channels * (self.conv_kernel - 1)
    }
    /// Values in one slot's recurrent state of one layer.
    pub fn recurrent_len(&self) -> usize {
        self.v_heads * self.k_dim * self.v_dim
    }
    /// Bytes of one slot over every recurrent layer (f32).
    pub fn bytes_per_slot(&self) -> u64 {
        (self.layers * (self.conv_len() + self.recurrent_len()) * 4) as u64
    }
    /// Value heads per query/key head.
    pub fn group(&self) -> usize {
        self.v_heads / self.k_heads
    }
}

/// One recurrent layer's state of every slot.
#[derive(Clone, Debug)]
pub struct StateLayer {
    /// `[slots, conv_channels * (conv_kernel - 1)]` f32, channel major.
    pub conv: Tensor,
    /// `[slots, v_heads * k_dim * v_dim]` f32.
    pub recurrent: Tensor,
}

/// One sequence of a [`GatedDeltaNet`] call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StateSeq {
    /// The sequence's rows in the packed batch.
    pub rows: Range<usize>,
    /// Its state slot.
    pub slot: u32,
    /// It starts at position 0: its state starts from zero.
    pub fresh: bool,
    /// Copy the state after this sequence's first `n` tokens (`1..=rows`)
    /// into another slot, for each `(n, slot)`: a snapshot at a page
    /// boundary (prefix reuse), or the state at each draft token of a
    /// speculative verification (kept up to the accepted one).
    pub snapshots: Vec<(usize, u32)>,
}

/// The per-layer weights of a Gated DeltaNet's recurrence (all f32).
#[derive(Clone, Copy, Debug)]
pub struct GatedDeltaWeights<'a> {
    /// Depthwise convolution `[conv_channels, conv_kernel]`.
    pub conv: &'a Tensor,
    /// `A_log` `[v_heads]`.
    pub a_log: &'a Tensor,
    /// `dt_bias` `[v_heads]`.
    pub dt_bias: &'a Tensor,
}

/// One recurrent layer's token mixing over a batch ([`Backend::gated_delta_net`]):
/// the causal convolution with SiLU over `mixed` (`[t, conv_channels]`:
/// queries, keys, values of every head), L2-normalized queries (scaled by
/// `k_dim^-1/2`) and keys, decay `exp(-exp(A_log) * softplus(a + dt_bias))`,
/// `beta = sigmoid(b)`, and the gated delta rule per value head; the
/// output `[t, v_heads * v_dim]` is the state read by each query.
#[derive(Clone, Copy, Debug)]
pub struct GatedDeltaNet<'a> {
    /// The state's shape.
    pub spec: &'a StateSpec,
    /// `[t, conv_channels]` f32: the input projection before the convolution.
    pub mixed: &'a Tensor,
    /// `[t, v_heads]` f32: the decay's input projection.
    pub a: &'a Tensor,
    /// `[t, v_heads]` f32: the update strength's input projection.
    pub b: &'a Tensor,
    /// The layer's weights.
    pub weights: GatedDeltaWeights<'a>,
    /// The layer's state of every slot (read and updated).
    pub state: &'a StateLayer,
    /// The batch's sequences, in row order.
    pub seqs: &'a [StateSeq],
    /// `[t, v_heads * v_dim]` f32 output.
    pub out: &'a Tensor,
}

impl GatedDeltaNet<'_> {
    /// Checks shapes, dtypes and slots; returns the token count.
    pub fn check(&self) -> Result<usize> {
        let s = self.spec;
        let t = self.mixed.rows();
        let f32s = [
            self.mixed,
            self.a,
            self.b,
            self.weights.conv,
            self.weights.a_log,
            self.weights.dt_bias,
            &self.state.conv,
            &self.state.recurrent,
            self.out,
        ];
        if f32s.iter().any(|x| x.dtype() != DType::F32) {
            return Err(CoreError::invalid("gated delta net tensors must be f32"));
        }
        let shapes_ok = self.mixed.row_len() == s.conv_channels
            && self.a.rows() == t
            && self.a.row_len() == s.v_heads
            && self.b.rows() == t
            && self.b.row_len() == s.v_heads
            && self.weights.conv.numel() == s.conv_channels * s.conv_kernel
            && self.weights.a_log.numel() == s.v_heads
            && self.weights.dt_bias.numel() == s.v_heads
            && self.state.conv.row_len() == s.conv_len()
            && self.state.recurrent.row_len() == s.recurrent_len()
            && self.state.conv.rows() == self.state.recurrent.rows()
            && self.out.rows() == t
            && self.out.row_len() == s.v_heads * s.v_dim;
        if !shapes_ok {
            return Err(CoreError::invalid(format!(
                "gated delta net over {:?} with a {:?}, b {:?}, out {:?} does not fit {s:?}",
                self.mixed, self.a, self.b, self.out
            )));
        }
        let slots = self.state.conv.rows();
        let mut end = 0;
        let mut seen = Vec::with_capacity(self.seqs.len());
        for q in self.seqs {
            if q.rows.start != end || q.rows.is_empty() || q.slot as usize >= slots {
                return Err(CoreError::invalid(format!(
                    "state sequence {q:?} (after row {end}, {slots} slots)"
                )));
            }
            if seen.contains(&q.slot) {
                return Err(CoreError::invalid(format!(
                    "state slot {} used twice in one batch",
                    q.slot
                )));
            }
            seen.push(q.slot);
            end = q.rows.end;
        }
        // Snapshot slots: inside the cache, within the sequence's tokens,
        // and distinct from every other slot of the batch.
        for q in self.seqs {
            for &(n, dst) in &q.snapshots {
                if n == 0 || n > q.rows.len() || dst as usize >= slots || seen.contains(&dst) {
                    return Err(CoreError::invalid(format!(
                        "state snapshot {:?} of {q:?} ({slots} slots)",
                        (n, dst)
                    )));
                }
                seen.push(dst);
            }
        }
        if end != t {
            return Err(CoreError::invalid(format!(
                "state sequences cover {end} of {t} rows"
            )));
        }
        self.out.check_no_overlap(&[
            self.mixed,
            self.a,
            self.b,
            &self.state.conv,
            &self.state.recurrent,
        ])?;
        Ok(t)
    }
}

/// One query/key head group's inputs for [`gated_delta_group`]: the
/// sequence's rows of the packed inputs.
pub struct GroupInputs<'a> {
    /// `[tokens, conv_channels]` rows of `mixed` (row stride `conv_channels`).
    pub mixed: &'a [f32],
    /// `[tokens, v_heads]` rows of `a`.
    pub a: &'a [f32],
    /// `[tokens, v_heads]` rows of `b`.
    pub b: &'a [f32],
    /// The convolution weights `[conv_channels, conv_kernel]`.
    pub conv_w: &'a [f32],
    /// `A_log` `[v_heads]`.
    pub a_log: &'a [f32],
    /// `dt_bias` `[v_heads]`.
    pub dt_bias: &'a [f32],
}

/// One query/key head group's state, updated in place: the convolution
/// state of its query, key and value channels (channel major, `conv_kernel
/// - 1` values each, oldest first) and the recurrent state of its value
/// heads (`[group, k_dim, v_dim]`).
pub struct GroupState<'a> {
    /// The group's `k_dim` query channels.
    pub q_conv: &'a mut [f32],
    /// The group's `k_dim` key channels.
    pub k_conv: &'a mut [f32],
    /// The group's `group * v_dim` value channels.
    pub v_conv: &'a mut [f32],
    /// `[group, k_dim, v_dim]`.
    pub recurrent: &'a mut [f32],
}

/// `softplus` as torch computes it (`beta` 1, linear above 20).
#[inline]
fn softplus(x: f32) -> f32 {
    if x > 20.0 { x } else { x.exp().ln_1p() }
}

/// The causal convolution with SiLU of `channels` consecutive channels
/// starting at `first`, for every token: reads `x` (row stride `stride`),
/// the state (`kernel - 1` past inputs per channel) and writes `out`
/// (`[tokens, channels]`); the state ends holding the last inputs.
#[allow(clippy::too_many_arguments)]
fn conv_channels(
    x: &[f32],
    stride: usize,
    tokens: usize,
    first: usize,
    w: &[f32],
    kernel: usize,
    state: &mut [f32],
    fresh: bool,
    out: &mut [f32],
) {
    let channels = out.len() / tokens;
    let past = kernel - 1;
    if fresh {
        state.fill(0.0);
    }
    let mut window = vec![0f32; kernel];
    for c in 0..channels {
        let wc = &w[(first + c) * kernel..(first + c + 1) * kernel];
        let st = &mut state[c * past..(c + 1) * past];
        window[..past].copy_from_slice(st);
        for i in 0..tokens {
            window[past] = x[i * stride + first + c];
            let mut acc = 0f32;
            for j in 0..kernel {
                acc += wc[j] * window[j];
            }
            out[i * channels + c] = acc / (1.0 + (-acc).exp());
            window.copy_within(1.., 0);
        }
        st.copy_from_slice(&window[..past]);
    }
}

/// The convolution state (`past` inputs per channel, oldest first) after
/// the first `b` of a sequence's tokens, for the channels `first..` that
/// `dst` holds: the inputs `x` (row stride `stride`) before it, the state
/// `old` (zero when `fresh`) before those.
#[allow(clippy::too_many_arguments)]
fn conv_state_at(
    x: &[f32],
    stride: usize,
    first: usize,
    old: &[f32],
    fresh: bool,
    past: usize,
    b: usize,
    dst: &mut [f32],
) {
    let channels = dst.len() / past;
    for c in 0..channels {
        for j in 0..past {
            let t = (b + j) as isize - past as isize;
            dst[c * past + j] = if t >= 0 {
                x[t as usize * stride + first + c]
            } else if fresh {
                0.0
            } else {
                old[c * past + (past as isize + t) as usize]
            };
        }
    }
}

/// Scales `v` to unit L2 norm as the FLA kernels do (`x / sqrt(Σx² + 1e-6)`), times `scale`.
#[inline]
fn l2_normalize(v: &mut [f32], scale: f32) {
    let ss: f32 = v.iter().map(|x| x * x).sum();
    let inv = 1.0 / (ss + 1e-6).sqrt() * scale;
    for x in v {
        *x *= inv;
    }
}

/// Runs query/key head group `kh` of one sequence over its `tokens`
/// tokens: the convolution of the group's channels, the normalizations and
/// the gated delta rule of its value heads. Writes `out` (`[tokens, group *
/// v_dim]`). Every token costs the same operations in the same order, so
/// the state after each token does not depend on how the tokens were
/// batched (the module invariant).
#[allow(clippy::too_many_arguments)]
pub fn gated_delta_group(
    spec: &StateSpec,
    kh: usize,
    tokens: usize,
    fresh: bool,
    inp: &GroupInputs<'_>,
    st: GroupState<'_>,
    snapshots: &mut [(usize, GroupState<'_>)],
    out: &mut [f32],
) {
    let (dk, dv, g) = (spec.k_dim, spec.v_dim, spec.group());
    let (kernel, stride) = (spec.conv_kernel, spec.conv_channels);
    let key_base = spec.k_heads * dk;
    let value_base = 2 * key_base;
    let mut q = vec![0f32; tokens * dk];
    let mut k = vec![0f32; tokens * dk];
    let mut v = vec![0f32; tokens * g * dv];
    let (mx, w) = (inp.mixed, inp.conv_w);
    for (b, d) in snapshots.iter_mut() {
        let at = |first: usize, old: &[f32], dst: &mut [f32]| {
            conv_state_at(mx, stride, first, old, fresh, kernel - 1, *b, dst)
        };
        at(kh * dk, st.q_conv, d.q_conv);
        at(key_base + kh * dk, st.k_conv, d.k_conv);
        at(value_base + kh * g * dv, st.v_conv, d.v_conv);
    }
    conv_channels(
        mx,
        stride,
        tokens,
        kh * dk,
        w,
        kernel,
        st.q_conv,
        fresh,
        &mut q,
    );
    conv_channels(
        mx,
        stride,
        tokens,
        key_base + kh * dk,
        w,
        kernel,
        st.k_conv,
        fresh,
        &mut k,
    );
    let vfirst = value_base + kh * g * dv;
    conv_channels(
        mx, stride, tokens, vfirst, w, kernel, st.v_conv, fresh, &mut v,
    );
    let scale = 1.0 / (dk as f32).sqrt();
    for i in 0..tokens {
        l2_normalize(&mut q[i * dk..(i + 1) * dk], scale);
        l2_normalize(&mut k[i * dk..(i + 1) * dk], 1.0);
    }
    if fresh {
        st.recurrent.fill(0.0);
    }
    let mut kv_mem = vec![0f32; dv];
    for h in 0..g {
        let vh = kh * g + h;
        let a_neg = -inp.a_log[vh].exp();
        let s = &mut st.recurrent[h * dk * dv..(h + 1) * dk * dv];
        for i in 0..tokens {
            let decay = (a_neg * softplus(inp.a[i * spec.v_heads + vh] + inp.dt_bias[vh])).exp();
            let bx = inp.b[i * spec.v_heads + vh];
            let beta = 1.0 / (1.0 + (-bx).exp());
            let (qi, ki) = (&q[i * dk..(i + 1) * dk], &k[i * dk..(i + 1) * dk]);
            let vi = &v[i * g * dv + h * dv..i * g * dv + (h + 1) * dv];
            // Decay, and kv_mem = Sᵀk (rows of S in order).
            kv_mem.fill(0.0);
            for (r, &kr) in ki.iter().enumerate() {
                let row = &mut s[r * dv..(r + 1) * dv];
                for (sv, m) in row.iter_mut().zip(kv_mem.iter_mut()) {
                    *sv *= decay;
                    *m += *sv * kr;
                }
            }
            // delta = (v - kv_mem)·beta; S += k ⊗ delta; o = Sᵀq.
            for (m, &vj) in kv_mem.iter_mut().zip(vi) {
                *m = (vj - *m) * beta;
            }
            let o = &mut out[i * g * dv + h * dv..i * g * dv + (h + 1) * dv];
            o.fill(0.0);
            for r in 0..dk {
                let (kr, qr) = (ki[r], qi[r]);
                let row = &mut s[r * dv..(r + 1) * dv];
                for ((sv, &d), oj) in row.iter_mut().zip(kv_mem.iter()).zip(o.iter_mut()) {
                    *sv += kr * d;
                    *oj += *sv * qr;
                }
            }
            for (b, d) in snapshots.iter_mut() {
                if i + 1 == *b {
                    d.recurrent[h * dk * dv..(h + 1) * dk * dv].copy_from_slice(s);
                }
            }
        }
    }
}

/// Where query/key head group `kh`'s parts lie in one slot's state of one
/// layer: its query, key and value channels of the convolution state, in
/// that order and disjoint, and its value heads of the recurrent state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupRanges {
    /// Query channels of the convolution state.
    pub q_conv: Range<usize>,
    /// Key channels of the convolution state.
    pub k_conv: Range<usize>,
    /// Value channels of the convolution state.
    pub v_conv: Range<usize>,
    /// The group's value heads of the recurrent state.
    pub recurrent: Range<usize>,
}

/// The parts of group `kh` (see [`GroupRanges`]).
pub fn group_ranges(spec: &StateSpec, kh: usize) -> GroupRanges {
    let (dk, dv, g) = (spec.k_dim, spec.v_dim, spec.group());
    let past = spec.conv_kernel - 1;
    let key_base = spec.k_heads * dk * past;
    let qk = dk * past;
    let vlen = g * dv * past;
    let rlen = g * dk * dv;
    GroupRanges {
        q_conv: kh * qk..(kh + 1) * qk,
        k_conv: key_base + kh * qk..key_base + (kh + 1) * qk,
        v_conv: 2 * key_base + kh * vlen..2 * key_base + (kh + 1) * vlen,
        recurrent: kh * rlen..(kh + 1) * rlen,
    }
}

/// Splits one slot's state of one layer into group `kh`'s parts.
pub fn group_state<'a>(
    spec: &StateSpec,
    kh: usize,
    conv: &'a mut [f32],
    recurrent: &'a mut [f32],
) -> GroupState<'a> {
    let r = group_ranges(spec, kh);
    let (before_k, from_k) = conv.split_at_mut(r.k_conv.start);
    let (k_part, from_v) = from_k.split_at_mut(r.v_conv.start - r.k_conv.start);
    GroupState {
        q_conv: &mut before_k[r.q_conv],
        k_conv: &mut k_part[..r.k_conv.len()],
        v_conv: &mut from_v[..r.v_conv.len()],
        recurrent: &mut recurrent[r.recurrent],
    }
}

/// [`Backend::gated_delta_net`] on the host: downloads the inputs and the
/// batch's slots, runs [`gated_delta_group`], and writes the slots and the
/// output back. Any backend is correct with it; the CPU runs the same
/// kernel in place.
pub fn gated_delta_net_on_host<B: Backend + ?Sized>(b: &B, call: &GatedDeltaNet<'_>) -> Result<()> {
    let t = call.check()?;
    let s = call.spec;
    let mixed = f32_values(b, call.mixed)?;
    let (a, bb) = (f32_values(b, call.a)?, f32_values(b, call.b)?);
    let conv_w = f32_values(b, call.weights.conv)?;
    let a_log = f32_values(b, call.weights.a_log)?;
    let dt_bias = f32_values(b, call.weights.dt_bias)?;
    let width = s.v_heads * s.v_dim;
    let mut out = vec![0f32; t * width];
    let g = s.group();
    for q in call.seqs {
        let slot = q.slot as usize;
        let conv_t = call.state.conv.narrow(slot, 1)?;
        let rec_t = call.state.recurrent.narrow(slot, 1)?;
        let mut conv = f32_values(b, &conv_t)?;
        let mut rec = f32_values(b, &rec_t)?;
        let n = q.rows.len();
        let rows = q.rows.clone();
        let inp = GroupInputs {
            mixed: &mixed[rows.start * s.conv_channels..rows.end * s.conv_channels],
            a: &a[rows.start * s.v_heads..rows.end * s.v_heads],
            b: &bb[rows.start * s.v_heads..rows.end * s.v_heads],
            conv_w: &conv_w,
            a_log: &a_log,
            dt_bias: &dt_bias,
        };
        let snap_views = q
            .snapshots
            .iter()
            .map(|&(_, dst)| {
                Ok((
                    call.state.conv.narrow(dst as usize, 1)?,
                    call.state.recurrent.narrow(dst as usize, 1)?,
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        let mut snap = snap_views
            .iter()
            .map(|(c, r)| Ok((f32_values(b, c)?, f32_values(b, r)?)))
            .collect::<Result<Vec<_>>>()?;
        let mut group_out = vec![0f32; n * g * s.v_dim];
        for kh in 0..s.k_heads {
            let st = group_state(s, kh, &mut conv, &mut rec);
            let mut dst: Vec<_> = snap
                .iter_mut()
                .zip(&q.snapshots)
                .map(|((c, r), &(at, _))| (at, group_state(s, kh, c, r)))
                .collect();
            gated_delta_group(s, kh, n, q.fresh, &inp, st, &mut dst, &mut group_out);
            for i in 0..n {
                let dst = (rows.start + i) * width + kh * g * s.v_dim;
                out[dst..dst + g * s.v_dim]
                    .copy_from_slice(&group_out[i * g * s.v_dim..(i + 1) * g * s.v_dim]);
            }
        }
        b.write(&conv_t, &f32_bytes(&conv))?;
        b.write(&rec_t, &f32_bytes(&rec))?;
        for ((ct, rt), (c, r)) in snap_views.iter().zip(&snap) {
            b.write(ct, &f32_bytes(c))?;
            b.write(rt, &f32_bytes(r))?;
        }
    }
    b.write(call.out, &f32_bytes(&out))
}

/// `out = x * sigmoid(gate)` on the host ([`Backend::sigmoid_mul`]'s default).
pub fn sigmoid_mul_on_host<B: Backend + ?Sized>(
    b: &B,
    gate: &Tensor,
    x: &Tensor,
    out: &Tensor,
) -> Result<()> {
    gate.check_same_shape(x)?;
    gate.check_same_shape(out)?;
    out.check_no_overlap(&[gate, x])?;
    let (g, v) = (f32_values(b, gate)?, f32_values(b, x)?);
    let o: Vec<f32> = g
        .iter()
        .zip(&v)
        .map(|(&g, &v)| sigmoid_times(g, v))
        .collect();
    b.write(out, &f32_bytes(&o))
}

/// `x * sigmoid(g)`, the one formula every backend uses.
#[inline]
pub fn sigmoid_times(g: f32, x: f32) -> f32 {
    x / (1.0 + (-g).exp())
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> StateSpec {
        StateSpec {
            layers: 1,
            conv_channels: 2 * 2 * 4 + 4 * 3,
            conv_kernel: 4,
            k_heads: 2,
            v_heads: 4,
            k_dim: 4,
            v_dim: 3,
        }
    }

    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) % 1000) as f32 / 500.0 - 1.0
            })
            .collect()
    }

    /// Runs a whole sequence in chunks of `chunk` tokens; returns outputs and state.
    fn run_chunked(chunk: usize, tokens: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let s = spec();
        let mixed = values(tokens * s.conv_channels, 1);
        let a = values(tokens * s.v_heads, 2);
        let b = values(tokens * s.v_heads, 3);
        let w = values(s.conv_channels * s.conv_kernel, 4);
        let (a_log, dt) = (values(s.v_heads, 5), values(s.v_heads, 6));
        let mut conv = vec![7.0; s.conv_len()];
        let mut rec = vec![7.0; s.recurrent_len()];
        let g = s.group();
        let mut out = vec![0f32; tokens * s.v_heads * s.v_dim];
        let mut start = 0;
        while start < tokens {
            let n = chunk.min(tokens - start);
            let inp = GroupInputs {
                mixed: &mixed[start * s.conv_channels..(start + n) * s.conv_channels],
                a: &a[start * s.v_heads..(start + n) * s.v_heads],
                b: &b[start * s.v_heads..(start + n) * s.v_heads],
                conv_w: &w,
                a_log: &a_log,
                dt_bias: &dt,
            };
            for kh in 0..s.k_heads {
                let mut o = vec![0f32; n * g * s.v_dim];
                gated_delta_group(
                    &s,
                    kh,
                    n,
                    start == 0,
                    &inp,
                    group_state(&s, kh, &mut conv, &mut rec),
                    &mut [],
                    &mut o,
                );
                for i in 0..n {
                    let w = s.v_heads * s.v_dim;
                    let d = (start + i) * w + kh * g * s.v_dim;
                    out[d..d + g * s.v_dim]
                        .copy_from_slice(&o[i * g * s.v_dim..(i + 1) * g * s.v_dim]);
                }
            }
            start += n;
        }
        (out, conv, rec)
    }

    #[test]
    fn chunking_does_not_change_a_bit() {
        let whole = run_chunked(37, 37);
        for chunk in [1, 2, 5, 16] {
            assert_eq!(run_chunked(chunk, 37), whole, "chunk {chunk}");
        }
    }

    /// The recurrence against a direct transcription of transformers'
    /// `torch_recurrent_gated_delta_rule` (f64, separate loops).
    #[test]
    fn matches_the_published_recurrence() {
        let s = spec();
        let tokens = 9;
        let (out, _, _) = run_chunked(4, tokens);
        let mixed = values(tokens * s.conv_channels, 1);
        let a = values(tokens * s.v_heads, 2);
        let b = values(tokens * s.v_heads, 3);
        let w = values(s.conv_channels * s.conv_kernel, 4);
        let (a_log, dt) = (values(s.v_heads, 5), values(s.v_heads, 6));
        let c = s.conv_channels;
        // conv + silu in f64
        let mut y = vec![0f64; tokens * c];
        for t in 0..tokens {
            for ch in 0..c {
                let mut acc = 0f64;
                for j in 0..s.conv_kernel {
                    let src = t as isize - (s.conv_kernel - 1 - j) as isize;
                    if src >= 0 {
                        acc +=
                            w[ch * s.conv_kernel + j] as f64 * mixed[src as usize * c + ch] as f64;
                    }
                }
                y[t * c + ch] = acc / (1.0 + (-acc).exp());
            }
        }
        let (dk, dv) = (s.k_dim, s.v_dim);
        for vh in 0..s.v_heads {
            let kh = vh / s.group();
            let mut st = vec![0f64; dk * dv];
            for t in 0..tokens {
                let norm = |off: usize, scale: f64| {
                    let v: Vec<f64> = (0..dk).map(|i| y[t * c + off + i]).collect();
                    let n = (v.iter().map(|x| x * x).sum::<f64>() + 1e-6).sqrt();
                    v.iter().map(|x| x / n * scale).collect::<Vec<f64>>()
                };
                let q = norm(kh * dk, 1.0 / (dk as f64).sqrt());
                let k = norm(s.k_heads * dk + kh * dk, 1.0);
                let v: Vec<f64> = (0..dv)
                    .map(|j| y[t * c + 2 * s.k_heads * dk + vh * dv + j])
                    .collect();
                let x = a[t * s.v_heads + vh] as f64 + dt[vh] as f64;
                let sp = if x > 20.0 { x } else { x.exp().ln_1p() };
                let g = -(a_log[vh] as f64).exp() * sp;
                let beta = 1.0 / (1.0 + (-(b[t * s.v_heads + vh] as f64)).exp());
                st.iter_mut().for_each(|e| *e *= g.exp());
                let mem: Vec<f64> = (0..dv)
                    .map(|j| (0..dk).map(|i| st[i * dv + j] * k[i]).sum())
                    .collect();
                let delta: Vec<f64> = (0..dv).map(|j| (v[j] - mem[j]) * beta).collect();
                for i in 0..dk {
                    for j in 0..dv {
                        st[i * dv + j] += k[i] * delta[j];
                    }
                }
                for j in 0..dv {
                    let o: f64 = (0..dk).map(|i| st[i * dv + j] * q[i]).sum();
                    let got = out[t * s.v_heads * dv + vh * dv + j] as f64;
                    assert!(
                        (o - got).abs() < 1e-5,
                        "t {t} head {vh} dim {j}: {o} vs {got}"
                    );
                }
            }
        }
    }
}
