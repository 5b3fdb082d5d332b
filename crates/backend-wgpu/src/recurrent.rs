//! Gated DeltaNet layers on wgpu: [`Backend::gated_delta_net`] as
//! `gated_delta_net.wgsl` dispatches (a workgroup per sequence and
//! query/key head group, tokens in order, the state updated in place where
//! it lives), and gated attention's `sigmoid_mul`.
//!
//! The call is checked as the CPU checks it ([`GatedDeltaNet::check`]). The
//! kernel takes eight storage bindings: `a` and `b` are copied into one
//! buffer, `A_log` and `dt_bias` into another, and the sequence table and
//! its snapshots share a third. Where the adapter caps an invocation's loop
//! iterations (llvmpipe), the tokens are cut into windows that fit, each a
//! dispatch continuing the state the last one left: the same operations in
//! the same order, so the result does not change. A group wider than the
//! kernel's workgroup buffer runs through the host default.

use crate::context::{Access, Params};
use crate::kernels::{Kernel, grid_threads};
use crate::{WgpuBackend, u32_of};
use arbor_engine_core::backend::recurrent::{GatedDeltaNet, StateSeq, gated_delta_net_on_host};
use arbor_engine_core::{Backend, DType, Result, Tensor};

/// Floats of the kernel's workgroup buffer (the group's channels and two norms).
const GROUP_BUFFER: usize = 2050;
/// Invocations of a workgroup (`WG`).
const WG: usize = 64;

/// The sequence table of one dispatch: 6 words per sequence, then the
/// snapshots' (n, slot) pairs.
fn table(seqs: &[StateSeq]) -> Result<Vec<u32>> {
    let mut head = Vec::with_capacity(6 * seqs.len());
    let mut snaps = Vec::new();
    for q in seqs {
        head.extend([
            u32_of(q.rows.start, "state rows")?,
            u32_of(q.rows.len(), "state rows")?,
            q.slot,
            u32::from(q.fresh),
            u32_of(snaps.len() / 2, "state snapshots")?,
            u32_of(q.snapshots.len(), "state snapshots")?,
        ]);
        for &(n, dst) in &q.snapshots {
            snaps.extend([u32_of(n, "state snapshot")?, dst]);
        }
    }
    head.extend(snaps);
    Ok(head)
}

/// The sequences' tokens `[from, from + window)` of their own (those that
/// have any): rows, freshness and snapshots of that window.
fn window(seqs: &[StateSeq], from: usize, window: usize) -> Vec<StateSeq> {
    seqs.iter()
        .filter(|q| q.rows.len() > from)
        .map(|q| {
            let end = (from + window).min(q.rows.len());
            StateSeq {
                rows: q.rows.start + from..q.rows.start + end,
                slot: q.slot,
                fresh: q.fresh && from == 0,
                snapshots: q
                    .snapshots
                    .iter()
                    .filter(|(n, _)| *n > from && *n <= end)
                    .map(|&(n, dst)| (n - from, dst))
                    .collect(),
            }
        })
        .collect()
}

pub fn gated_delta_net(b: &WgpuBackend, call: &GatedDeltaNet<'_>) -> Result<()> {
    let t = call.check()?;
    let s = call.spec;
    let cols = s.group() * s.v_dim;
    let gch = 2 * s.k_dim + cols;
    if gch + 2 > GROUP_BUFFER || s.conv_kernel < 2 {
        return gated_delta_net_on_host(b, call);
    }
    if call.seqs.is_empty() {
        return Ok(());
    }
    let dev: &dyn Backend = b;
    // a then b in one buffer; A_log then dt_bias in another.
    let ab = dev.alloc(DType::F32, &[2 * t, s.v_heads])?;
    dev.copy(call.a, &ab.narrow(0, t)?)?;
    dev.copy(call.b, &ab.narrow(t, t)?)?;
    let adt = dev.alloc(DType::F32, &[2 * s.v_heads])?;
    dev.copy(call.weights.a_log, &adt.narrow(0, s.v_heads)?)?;
    dev.copy(call.weights.dt_bias, &adt.narrow(s.v_heads, s.v_heads)?)?;
    // Tokens per dispatch: all, or what the loop budget allows.
    let longest = call.seqs.iter().map(|q| q.rows.len()).max().unwrap_or(0);
    let snaps = call
        .seqs
        .iter()
        .map(|q| q.snapshots.len())
        .max()
        .unwrap_or(0);
    let per_token = gch.div_ceil(WG) * (3 * s.conv_kernel + snaps * s.conv_kernel + 4)
        + 2 * s.k_dim
        + cols.div_ceil(WG) * (2 * s.k_dim + 4 + snaps * (s.k_dim + 1))
        + 8;
    let fixed = gch.div_ceil(WG) * s.conv_kernel + cols.div_ceil(WG) * s.k_dim + 64;
    let step = match b.gpu().loop_budget() {
        Some(budget) => ((budget * 9 / 10).saturating_sub(fixed) / per_token).max(1),
        None => longest,
    };
    let mv = b.view(call.mixed, DType::F32, Access::Read)?;
    let abv = b.view(&ab, DType::F32, Access::Read)?;
    let wv = b.view(call.weights.conv, DType::F32, Access::Read)?;
    let adtv = b.view(&adt, DType::F32, Access::Read)?;
    let csv = b.view(&call.state.conv, DType::F32, Access::Write)?;
    let rsv = b.view(&call.state.recurrent, DType::F32, Access::Write)?;
    let ov = b.view(call.out, DType::F32, Access::Write)?;
    let gpu = b.gpu();
    let pipe = gpu.kernel(&Kernel::GatedDeltaNet)?;
    let mut from = 0;
    while from < longest {
        let seqs = window(call.seqs, from, step);
        let words = table(&seqs)?;
        let tab = dev.upload_u32(&[words.len()], &words)?;
        let tv = b.view(&tab, DType::U32, Access::Read)?;
        let params = Params::new()
            .u(mv.word_off())
            .u(abv.word_off())
            .u(wv.word_off())
            .u(adtv.word_off())
            .u(csv.word_off())
            .u(rsv.word_off())
            .u(ov.word_off())
            .u(tv.word_off())
            .us(s.conv_channels)?
            .us(s.conv_kernel)?
            .us(s.k_heads)?
            .us(s.v_heads)?
            .us(s.k_dim)?
            .us(s.v_dim)?
            .us(t)?
            .us(seqs.len())?;
        let groups = (
            u32_of(seqs.len(), "state sequences")?,
            u32_of(s.k_heads, "k heads")?,
            1,
        );
        gpu.dispatch(
            &pipe,
            &params,
            &[&mv, &abv, &wv, &adtv, &csv, &rsv, &ov, &tv],
            groups,
        )?;
        from += step;
    }
    Ok(())
}

pub fn sigmoid_mul(b: &WgpuBackend, gate: &Tensor, x: &Tensor, out: &Tensor) -> Result<()> {
    gate.check_same_shape(x)?;
    gate.check_same_shape(out)?;
    out.check_no_overlap(&[gate, x])?;
    let gv = b.view(gate, DType::F32, Access::Read)?;
    let xv = b.view(x, DType::F32, Access::Read)?;
    let ov = b.view(out, DType::F32, Access::Write)?;
    let gpu = b.gpu();
    let pipe = gpu.kernel(&Kernel::SigmoidMul)?;
    let n = gate.numel();
    let params = Params::new()
        .u(u32_of(n, "sigmoid_mul size")?)
        .u(gv.word_off())
        .u(xv.word_off())
        .u(ov.word_off());
    let groups = grid_threads(n, gpu.limits.max_compute_workgroups_per_dimension)?;
    gpu.dispatch(&pipe, &params, &[&gv, &xv, &ov], groups)
}
