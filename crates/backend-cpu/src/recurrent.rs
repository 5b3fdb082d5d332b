//! The recurrent layers' kernels on the CPU: the Gated DeltaNet over a
//! batch's state slots, and the sigmoid output gate.
//!
//! [`gated_delta_net`] runs engine-core's reference recurrence
//! ([`gated_delta_group`]) in place on host memory: one unit of work per
//! (sequence, query/key head group), spread over the pool. Units write
//! disjoint memory: each owns its group's channels of its sequence's slot
//! (slots are distinct within a batch, checked by the call) and its group's
//! columns of its sequence's output rows. A unit's arithmetic is the
//! reference's, token after token, so the state after a token does not
//! depend on the batch or the chunking (batch invariance).

use crate::CpuBackend;
use crate::memory::SendPtr;
use crate::pool::share;
use arbor_engine_core::state::{
    GatedDeltaNet, GroupInputs, GroupState, gated_delta_group, group_ranges, sigmoid_times,
};
use arbor_engine_core::{DType, Result, Tensor};

fn f32_ptr(b: &CpuBackend, t: &Tensor) -> Result<SendPtr<f32>> {
    let v = b.view(t, DType::F32)?;
    Ok(SendPtr(v.ptr as *mut f32))
}

pub fn gated_delta_net(b: &CpuBackend, call: &GatedDeltaNet<'_>) -> Result<()> {
    let t = call.check()?;
    let s = *call.spec;
    let slots = call.state.conv.rows();
    let (mixed, a, beta) = (
        f32_ptr(b, call.mixed)?,
        f32_ptr(b, call.a)?,
        f32_ptr(b, call.b)?,
    );
    let (conv_w, a_log, dt_bias) = (
        f32_ptr(b, call.weights.conv)?,
        f32_ptr(b, call.weights.a_log)?,
        f32_ptr(b, call.weights.dt_bias)?,
    );
    let (conv, rec, out) = (
        f32_ptr(b, &call.state.conv)?,
        f32_ptr(b, &call.state.recurrent)?,
        f32_ptr(b, call.out)?,
    );
    let (conv_len, rec_len) = (s.conv_len(), s.recurrent_len());
    let g = s.group();
    let width = s.v_heads * s.v_dim;
    let units = call.seqs.len() * s.k_heads;
    let unit = |u: usize| {
        let (q, kh) = (&call.seqs[u / s.k_heads], u % s.k_heads);
        let (r0, n) = (q.rows.start, q.rows.len());
        let slot = q.slot as usize;
        debug_assert!(slot < slots && q.rows.end <= t);
        // SAFETY: the inputs are read-only f32 views of their checked
        // shapes; this unit's slot rows and output columns are written by
        // no other unit (distinct slots per sequence, distinct groups per
        // slot), see the module doc.
        unsafe {
            let inp = GroupInputs {
                mixed: std::slice::from_raw_parts(
                    mixed.get().add(r0 * s.conv_channels),
                    n * s.conv_channels,
                ),
                a: std::slice::from_raw_parts(a.get().add(r0 * s.v_heads), n * s.v_heads),
                b: std::slice::from_raw_parts(beta.get().add(r0 * s.v_heads), n * s.v_heads),
                conv_w: std::slice::from_raw_parts(conv_w.get(), s.conv_channels * s.conv_kernel),
                a_log: std::slice::from_raw_parts(a_log.get(), s.v_heads),
                dt_bias: std::slice::from_raw_parts(dt_bias.get(), s.v_heads),
            };
            // Only the group's parts of the slot are borrowed.
            let r = group_ranges(&s, kh);
            let part = |base: &SendPtr<f32>, at: usize, range: std::ops::Range<usize>| {
                std::slice::from_raw_parts_mut(base.get().add(at + range.start), range.len())
            };
            let st = GroupState {
                q_conv: part(&conv, slot * conv_len, r.q_conv.clone()),
                k_conv: part(&conv, slot * conv_len, r.k_conv.clone()),
                v_conv: part(&conv, slot * conv_len, r.v_conv.clone()),
                recurrent: part(&rec, slot * rec_len, r.recurrent.clone()),
            };
            // The snapshot slots' parts of this group, likewise this unit's alone.
            let mut snaps: Vec<_> = q
                .snapshots
                .iter()
                .map(|&(at, dst)| {
                    let d = dst as usize;
                    (
                        at,
                        GroupState {
                            q_conv: part(&conv, d * conv_len, r.q_conv.clone()),
                            k_conv: part(&conv, d * conv_len, r.k_conv.clone()),
                            v_conv: part(&conv, d * conv_len, r.v_conv.clone()),
                            recurrent: part(&rec, d * rec_len, r.recurrent.clone()),
                        },
                    )
                })
                .collect();
            let mut o = vec![0f32; n * g * s.v_dim];
            gated_delta_group(&s, kh, n, q.fresh, &inp, st, &mut snaps, &mut o);
            for i in 0..n {
                let dst = out.get().add((r0 + i) * width + kh * g * s.v_dim);
                std::ptr::copy_nonoverlapping(o.as_ptr().add(i * g * s.v_dim), dst, g * s.v_dim);
            }
        }
    };
    if units == 1 {
        unit(0);
        return Ok(());
    }
    b.parallel(&|i, n| {
        let (u0, u1) = share(units, i, n, 1);
        for u in u0..u1 {
            unit(u);
        }
    })
}

pub fn sigmoid_mul(b: &CpuBackend, gate: &Tensor, x: &Tensor, out: &Tensor) -> Result<()> {
    gate.check_same_shape(x)?;
    gate.check_same_shape(out)?;
    out.check_no_overlap(&[gate, x])?;
    let (g, v, o) = (f32_ptr(b, gate)?, f32_ptr(b, x)?, f32_ptr(b, out)?);
    let n = gate.numel();
    // SAFETY: three f32 views of n elements; `out` overlaps neither input.
    unsafe {
        let (g, v) = (
            std::slice::from_raw_parts(g.get(), n),
            std::slice::from_raw_parts(v.get(), n),
        );
        let o = std::slice::from_raw_parts_mut(o.get(), n);
        for ((o, &g), &v) in o.iter_mut().zip(g).zip(v) {
            *o = sigmoid_times(g, v);
        }
    }
    Ok(())
}
