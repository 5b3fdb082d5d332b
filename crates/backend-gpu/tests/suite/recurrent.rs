//! A Gated DeltaNet layer's recurrence (`Backend::gated_delta_net`) and
//! gated attention's `sigmoid_mul` against the CPU backend, on seeded
//! random inputs: two sequences in one batch (one fresh over a slot holding
//! old values, one continuing a stored state), with snapshots at chosen
//! tokens, give the CPU's outputs, states and snapshots within 1e-4 of their
//! scale; on the device the same tokens in chunks of 5 give bit-identical
//! outputs, states and snapshots (the recurrence does not depend on how the
//! tokens were batched). A 700-token sequence with 64-wide heads (which
//! wgpu on llvmpipe cuts into several dispatches to stay within its loop
//! budget) matches the CPU too.

use crate::common::*;
use arbor_engine_core::state::{GatedDeltaNet, GatedDeltaWeights, StateLayer, StateSeq};
use arbor_engine_core::{Backend, DType, StateSpec};

const SLOTS: usize = 6;

fn spec() -> StateSpec {
    StateSpec {
        layers: 1,
        conv_channels: 2 * 2 * 16 + 4 * 8,
        conv_kernel: 4,
        k_heads: 2,
        v_heads: 4,
        k_dim: 16,
        v_dim: 8,
    }
}

/// One query/key head of 64 and two value heads of 32.
fn wide() -> StateSpec {
    StateSpec {
        layers: 1,
        conv_channels: 2 * 64 + 2 * 32,
        conv_kernel: 4,
        k_heads: 1,
        v_heads: 2,
        k_dim: 64,
        v_dim: 32,
    }
}

/// A sequence's inputs: `[tokens, conv_channels]`, and `a`, `b` `[tokens, v_heads]`.
struct Stream {
    mixed: Vec<f32>,
    a: Vec<f32>,
    b: Vec<f32>,
}

impl Stream {
    fn new(rng: &mut Rng, s: &StateSpec, tokens: usize) -> Self {
        Self {
            mixed: rng.vec(tokens * s.conv_channels, 1.5),
            a: rng.vec(tokens * s.v_heads, 2.0),
            b: rng.vec(tokens * s.v_heads, 2.0),
        }
    }
}

/// A sequence of a run: its inputs, slot, whether it starts fresh, and
/// its snapshots `(after this many tokens, into slot)`.
type Seq<'a> = (&'a Stream, u32, bool, &'a [(usize, u32)]);

/// What a run leaves: outputs of each stream (`[tokens, v_heads * v_dim]`),
/// then every slot's conv and recurrent state.
type Run = (Vec<Vec<f32>>, Vec<f32>, Vec<f32>);

/// Runs `streams` (slot, fresh, snapshots at absolute token counts) through
/// one layer in chunks of `chunk` tokens, both sequences in each call.
fn run(b: &dyn Backend, s: StateSpec, streams: &[Seq<'_>], chunk: usize) -> Run {
    let mut rng = Rng::new(7);
    let conv_w = upload_f32(
        b,
        &[s.conv_channels, s.conv_kernel],
        &rng.vec(s.conv_channels * s.conv_kernel, 0.7),
    );
    let a_log = upload_f32(b, &[s.v_heads], &rng.vec(s.v_heads, 1.0));
    let dt_bias = upload_f32(b, &[s.v_heads], &rng.vec(s.v_heads, 1.0));
    let state = StateLayer {
        conv: upload_f32(
            b,
            &[SLOTS, s.conv_len()],
            &rng.vec(SLOTS * s.conv_len(), 1.0),
        ),
        recurrent: upload_f32(
            b,
            &[SLOTS, s.recurrent_len()],
            &rng.vec(SLOTS * s.recurrent_len(), 0.5),
        ),
    };
    let width = s.v_heads * s.v_dim;
    let lens: Vec<usize> = streams.iter().map(|x| x.0.a.len() / s.v_heads).collect();
    let mut outs: Vec<Vec<f32>> = lens.iter().map(|&n| vec![0.0; n * width]).collect();
    let mut start = 0;
    while lens.iter().any(|&n| start < n) {
        let (mut mixed, mut a, mut bb, mut seqs) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut row = 0;
        let mut spans = Vec::new();
        for (i, (st, slot, fresh, snaps)) in streams.iter().enumerate() {
            let n = chunk.min(lens[i].saturating_sub(start));
            if n == 0 {
                continue;
            }
            let (c, v) = (s.conv_channels, s.v_heads);
            mixed.extend_from_slice(&st.mixed[start * c..(start + n) * c]);
            a.extend_from_slice(&st.a[start * v..(start + n) * v]);
            bb.extend_from_slice(&st.b[start * v..(start + n) * v]);
            seqs.push(StateSeq {
                rows: row..row + n,
                slot: *slot,
                fresh: *fresh && start == 0,
                snapshots: snaps
                    .iter()
                    .filter(|(at, _)| *at > start && *at <= start + n)
                    .map(|&(at, dst)| (at - start, dst))
                    .collect(),
            });
            spans.push((i, row, n));
            row += n;
        }
        let t = row;
        let out = b.alloc(DType::F32, &[t, width]).unwrap();
        let (m, at, btt) = (
            upload_f32(b, &[t, s.conv_channels], &mixed),
            upload_f32(b, &[t, s.v_heads], &a),
            upload_f32(b, &[t, s.v_heads], &bb),
        );
        b.gated_delta_net(&GatedDeltaNet {
            spec: &s,
            mixed: &m,
            a: &at,
            b: &btt,
            weights: GatedDeltaWeights {
                conv: &conv_w,
                a_log: &a_log,
                dt_bias: &dt_bias,
            },
            state: &state,
            seqs: &seqs,
            out: &out,
        })
        .unwrap();
        let o = download_f32(b, &out);
        for (i, row, n) in spans {
            outs[i][start * width..(start + n) * width]
                .copy_from_slice(&o[row * width..(row + n) * width]);
        }
        start += chunk;
    }
    (
        outs,
        download_f32(b, &state.conv),
        download_f32(b, &state.recurrent),
    )
}

#[test]
fn gated_delta_net_matches_the_cpu_and_ignores_chunking() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    let mut rng = Rng::new(11);
    let s = spec();
    let (x, y) = (Stream::new(&mut rng, &s, 37), Stream::new(&mut rng, &s, 21));
    let streams: [Seq<'_>; 2] = [
        (&x, 0, true, &[(16, 2), (37, 3)]),
        (&y, 1, false, &[(5, 4)]),
    ];
    let whole_gpu = run(&*g, s, &streams, 64);
    let whole_cpu = run(&*c, s, &streams, 64);
    for (i, (go, co)) in whole_gpu.0.iter().zip(&whole_cpu.0).enumerate() {
        assert_close(&format!("gated delta net output {i}"), go, co, 1e-4);
    }
    assert_close("conv states", &whole_gpu.1, &whole_cpu.1, 1e-4);
    assert_close("recurrent states", &whole_gpu.2, &whole_cpu.2, 1e-4);
    let chunked = run(&*g, s, &streams, 5);
    assert_eq!(
        chunked, whole_gpu,
        "chunks of 5 against one call, on the device"
    );
}

#[test]
fn a_long_sequence_with_wide_heads_matches_the_cpu() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    let mut rng = Rng::new(13);
    let s = wide();
    let x = Stream::new(&mut rng, &s, 700);
    let streams: [Seq<'_>; 1] = [(&x, 1, true, &[(333, 4), (700, 5)])];
    let (go, gc, gr) = run(&*g, s, &streams, 700);
    let (co, cc, cr) = run(&*c, s, &streams, 700);
    assert_close("long output", &go[0], &co[0], 1e-4);
    assert_close("long conv states", &gc, &cc, 1e-4);
    assert_close("long recurrent states", &gr, &cr, 1e-4);
}

#[test]
fn sigmoid_mul_matches() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    let mut rng = Rng::new(12);
    let (rows, dim) = (3, 517);
    let (gate, x) = (rng.vec(rows * dim, 8.0), rng.vec(rows * dim, 2.0));
    let run = |b: &dyn Backend| {
        let gt = upload_f32(b, &[rows, dim], &gate);
        let xt = upload_f32(b, &[rows, dim], &x);
        let o = b.alloc(DType::F32, &[rows, dim]).unwrap();
        b.sigmoid_mul(&gt, &xt, &o).unwrap();
        download_f32(b, &o)
    };
    assert_close("sigmoid_mul", &run(&*g), &run(&*c), 1e-5);
}
