//! Device sampling against the host: greedy rows equal the host argmax
//! (lowest index among ties); seeded draws repeat; top-k, top-p and min-p keep
//! only allowed tokens; and over many seeds the drawn frequencies follow the
//! tempered softmax (each within 0.03 of its probability over 4000 draws).
#![allow(clippy::unwrap_used)]

mod common;

use arbor_engine_core::backend::SampleRow;
use arbor_engine_core::sampling::argmax;
use arbor_engine_core::{Backend, DType};
use common::*;

fn row(temperature: f32, top_k: u32, top_p: f32, min_p: f32, seed: u64) -> SampleRow {
    SampleRow {
        temperature,
        top_k,
        top_p,
        min_p,
        seed,
    }
}

fn sample(b: &dyn Backend, logits: &[f32], vocab: usize, rows: &[SampleRow]) -> Vec<u32> {
    let l = upload_f32(b, &[rows.len(), vocab], logits);
    let o = b.alloc(DType::U32, &[rows.len()]).unwrap();
    b.sample(&l, rows, &o).unwrap();
    download_u32(b, &o)
}

#[test]
fn greedy_rows_take_the_argmax() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng::new(11);
    let vocab = 49152;
    let mut logits = rng.vec(3 * vocab, 8.0);
    // Ties resolve to the lowest index; masked logits are skipped.
    logits[vocab + 100] = 50.0;
    logits[vocab + 7000] = 50.0;
    for v in &mut logits[2 * vocab..2 * vocab + 5000] {
        *v = f32::NEG_INFINITY;
    }
    let rows = [
        row(0.0, 0, 1.0, 0.0, 1),
        row(0.0, 0, 1.0, 0.0, 2),
        row(1.0, 1, 1.0, 0.0, 3),
    ];
    let got = sample(&*g, &logits, vocab, &rows);
    let want: Vec<u32> = logits.chunks(vocab).map(argmax).collect();
    assert_eq!(got, want);
    assert_eq!(got[1], 100);
    // The CPU's default implementation agrees.
    assert_eq!(sample(&*cpu(), &logits, vocab, &rows), want);
}

#[test]
fn filters_and_seeds() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng::new(12);
    let vocab = 1000;
    let logits = rng.vec(vocab, 4.0);
    let mut order: Vec<u32> = (0..vocab as u32).collect();
    order.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
    let top5 = &order[..5];
    let rows: Vec<SampleRow> = (0..64).map(|s| row(0.8, 5, 1.0, 0.0, s)).collect();
    let all: Vec<f32> = rows.iter().flat_map(|_| logits.iter().copied()).collect();
    let a = sample(&*g, &all, vocab, &rows);
    assert!(a.iter().all(|t| top5.contains(t)), "top-k: {a:?}");
    assert_eq!(
        a,
        sample(&*g, &all, vocab, &rows),
        "same seeds, same tokens"
    );
    assert!(a.iter().any(|&t| t != a[0]), "different seeds vary");
    // A small nucleus or a high min_p keeps only the top token.
    let rows: Vec<SampleRow> = (0..32).map(|s| row(1.0, 0, 1e-6, 0.0, s)).collect();
    let all: Vec<f32> = rows.iter().flat_map(|_| logits.iter().copied()).collect();
    assert!(
        sample(&*g, &all, vocab, &rows)
            .iter()
            .all(|&t| t == order[0])
    );
    let rows: Vec<SampleRow> = (0..32).map(|s| row(1.0, 0, 1.0, 0.999, s)).collect();
    assert!(
        sample(&*g, &all, vocab, &rows)
            .iter()
            .all(|&t| t == order[0])
    );
}

#[test]
fn draws_follow_the_distribution() {
    let Some(g) = gpu() else { return };
    let logits = [1.0f32, 0.0, 2.0, -1.0, 0.5, f32::NEG_INFINITY];
    let vocab = logits.len();
    let t = 0.7;
    let n = 4000;
    let rows: Vec<SampleRow> = (0..n).map(|s| row(t, 0, 1.0, 0.0, s * 7919 + 1)).collect();
    let all: Vec<f32> = rows.iter().flat_map(|_| logits.iter().copied()).collect();
    let got = sample(&*g, &all, vocab, &rows);
    let w: Vec<f32> = logits.iter().map(|l| ((l - 2.0) / t).exp()).collect();
    let z: f32 = w.iter().sum();
    let mut counts = vec![0usize; vocab];
    for &id in &got {
        counts[id as usize] += 1;
    }
    for i in 0..vocab {
        let f = counts[i] as f32 / n as f32;
        assert!(
            (f - w[i] / z).abs() < 0.03,
            "token {i}: {f} vs {}",
            w[i] / z
        );
    }
    assert_eq!(counts[5], 0);
    // top_p 0.8 keeps the smallest head holding 80% of the mass.
    let rows: Vec<SampleRow> = (0..1000).map(|s| row(t, 0, 0.8, 0.0, s)).collect();
    let all: Vec<f32> = rows.iter().flat_map(|_| logits.iter().copied()).collect();
    let mut sorted: Vec<usize> = (0..vocab).collect();
    sorted.sort_by(|&a, &b| w[b].total_cmp(&w[a]));
    let mut acc = 0.0;
    let mut keep = Vec::new();
    for &i in &sorted {
        keep.push(i as u32);
        acc += w[i] / z;
        if acc >= 0.8 {
            break;
        }
    }
    let got = sample(&*g, &all, vocab, &rows);
    assert!(
        got.iter().all(|id| keep.contains(id)),
        "top-p kept {keep:?}, drew {got:?}"
    );
}
