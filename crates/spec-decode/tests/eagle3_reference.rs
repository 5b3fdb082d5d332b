//! The EAGLE3 draft head against the independent float64 PyTorch reference
//! of `tools/reference/make_eagle3_fixture.py` (tests/fixtures/eagle3-tiny-llama):
//!
//! - the target features Arbor computes for tiny-llama (`hidden_layers` =
//!   the head's aux layers) match the reference's, which come from
//!   transformers' decoder-layer outputs;
//! - `fuse` matches the reference's `fc(features)`;
//! - the head's prefill (both prompts in one batch, ids shifted by one) and
//!   three greedy chain steps (each feeding the previous `aux` and the
//!   previous draft token mapped to its target id) through a KV cache of
//!   the head's `kv_spec` match the reference's logits and aux within
//!   `TOL · max(1, max|x|)`, and choose exactly its tokens; once on the
//!   reference's features, once end to end on Arbor's own;
//! - a head without `embed_tokens.weight` runs on the target's embedding;
//! - a hidden size that does not fit the target, a missing `d2t`, a wrong
//!   `draft_vocab_size` and aux layers outside the target are refused with
//!   errors that name the key or tensor.
#![allow(clippy::unwrap_used)]

#[path = "support/heads.rs"]
mod heads;

use arbor_engine_core::speculative::SpeculativeConfig;
use arbor_engine_core::{DType, Draft, Registry, SamplingParams, Speculator, Tensor, WeightSource};
use arbor_models::safetensors_source::SafetensorsSource;
use arbor_spec_decode::Eagle3Head;
use heads::{
    Keys, R, TOL, check_runs, compare, fixtures, head_dir, ints, propose_on_reference,
    propose_sampled_on_reference, reference_chain, rows, run_head, shared, speculator_inputs,
    split_rows, target_states,
};
use serde_json::Value;
use std::path::Path;
use std::sync::Arc;

/// The target (`tests/fixtures/tiny-llama`) and the head (with its reference).
const TARGET: &str = "tiny-llama";
const HEAD: &str = "eagle3-tiny-llama";
/// The reference's names for the head's outputs (`aux`, target ids).
const KEYS: Keys = Keys {
    state: "aux",
    tokens: "target_ids",
    token: "target_id",
};

fn load_head(dir: &Path, embed: Option<Tensor>) -> arbor_engine_core::Result<Eagle3Head> {
    let s = shared();
    Eagle3Head::load(dir, s.target.model.spec(), embed, s.backend.clone())
}

#[test]
fn prefill_and_chain_match_the_reference() -> R {
    let s = shared();
    let reference = &s.reference;
    let head = load_head(&head_dir(), None)?;
    let layers = head.aux_layers();
    assert_eq!(
        layers.to_vec(),
        ints(&reference["aux_layer_ids"])
            .iter()
            .map(|&l| l as usize)
            .collect::<Vec<_>>()
    );
    assert_eq!(head.draft_vocab_size(), 128);
    let hot = ints(&reference["hot_ids"]);
    for (d, &t) in hot.iter().enumerate() {
        assert_eq!(head.target_id(d as u32)?, t);
    }
    assert!(head.target_id(hot.len() as u32).is_err());

    let seqs = reference["sequences"].as_array().unwrap();
    let (mut ids, mut ref_feats, mut own_feats) = (Vec::new(), Vec::new(), Vec::new());
    let (mut feat_err, mut fuse_err) = (0f32, 0f32);
    for (i, seq) in seqs.iter().enumerate() {
        let pf = &seq["prefill"];
        let prompt = ints(&seq["prompt_ids"]);
        let want = rows(&pf["features"]);
        let n = want.len();
        assert_eq!(ints(&pf["input_ids"]), prompt[1..].to_vec());
        let mut own = target_states(&layers, &prompt)?;
        own.truncate(n);
        feat_err = feat_err.max(compare(&format!("seq {i} target features"), &own, &want));
        // fc alone.
        let flat: Vec<f32> = want.iter().flatten().copied().collect();
        let fused = head.fuse(&s.backend.upload_f32(&[n, want[0].len()], &flat)?)?;
        let fused = split_rows(&s.backend.download_f32(&fused)?, head.hidden_size());
        fuse_err = fuse_err.max(compare(
            &format!("seq {i} fuse"),
            &fused,
            &rows(&pf["fused"]),
        ));
        ids.push(ints(&pf["input_ids"]));
        ref_feats.push(want);
        own_feats.push(own);
    }
    let runs = run_head(&head, &ids, &ref_feats, 3)?;
    let (el, ea) = check_runs("reference features", &KEYS, &runs, seqs);
    let runs = run_head(&head, &ids, &own_feats, 3)?;
    let (el2, ea2) = check_runs("Arbor features", &KEYS, &runs, seqs);
    eprintln!(
        "max abs errors: target features {feat_err:.2e}, fuse {fuse_err:.2e}; \
         on the reference's features: logits {el:.2e}, aux {ea:.2e}; \
         end to end on Arbor's features: logits {el2:.2e}, aux {ea2:.2e} (tolerance {TOL:e} x max(1, max|x|))"
    );
    Ok(())
}

/// A copy of the head folder with its config and tensors edited.
fn edited_head(
    edit_config: impl Fn(&mut Value),
    drop_tensor: Option<&str>,
) -> R<tempfile::TempDir> {
    heads::edited_copy(false, "model.safetensors", edit_config, drop_tensor)
}

#[test]
fn a_head_without_embeddings_uses_the_targets() -> R {
    let s = shared();
    let dir = edited_head(|_| {}, Some("embed_tokens.weight"))?;
    let err = load_head(dir.path(), None).unwrap_err().to_string();
    assert!(
        err.contains("embed_tokens.weight") && err.contains("missing"),
        "{err}"
    );
    let wrong = s.backend.alloc(DType::F32, &[500, 32])?;
    let err = load_head(dir.path(), Some(wrong)).unwrap_err().to_string();
    assert!(err.contains("[500, 64]"), "{err}");
    let src = SafetensorsSource::open(&fixtures().join("tiny-llama"))?;
    let embed = src.tensor("model.embed_tokens.weight")?.unwrap();
    let head = load_head(dir.path(), Some(s.backend.upload(&embed)?))?;
    let own = load_head(&head_dir(), None)?;
    let seqs = s.reference["sequences"].as_array().unwrap();
    let ids = vec![ints(&seqs[0]["prefill"]["input_ids"])];
    let feats = vec![rows(&seqs[0]["prefill"]["features"])];
    let a = run_head(&head, &ids, &feats, 1)?;
    let b = run_head(&own, &ids, &feats, 1)?;
    assert_eq!(a[0].prefill_logits, b[0].prefill_logits);
    assert_eq!(a[0].chain_logits, b[0].chain_logits);
    Ok(())
}

#[test]
fn heads_that_do_not_fit_are_refused() -> R {
    // Hidden size 32 against tiny-llama's 64 (without target_hidden_size,
    // which then defaults to hidden_size).
    let dir = edited_head(
        |c| {
            c["hidden_size"] = 32.into();
            c.as_object_mut().unwrap().remove("target_hidden_size");
        },
        None,
    )?;
    let err = load_head(dir.path(), None).unwrap_err().to_string();
    assert!(
        err.contains("'hidden_size'") && err.contains("64") && err.contains("32"),
        "{err}"
    );
    // With target_hidden_size 64 the head itself may be narrower, but then
    // its tensors must be, and it cannot borrow the target's embedding.
    let dir = edited_head(|c| c["hidden_size"] = 32.into(), None)?;
    let err = load_head(dir.path(), None).unwrap_err().to_string();
    assert!(
        err.contains("embed_tokens.weight") && err.contains("[500, 32]"),
        "{err}"
    );
    let dir = edited_head(
        |c| c["hidden_size"] = 32.into(),
        Some("embed_tokens.weight"),
    )?;
    let embed = shared().backend.alloc(DType::F32, &[500, 64])?;
    let err = load_head(dir.path(), Some(embed)).unwrap_err().to_string();
    assert!(
        err.contains("'hidden_size'") && err.contains("embedding"),
        "{err}"
    );
    let dir = edited_head(|c| c["target_hidden_size"] = 48.into(), None)?;
    let err = load_head(dir.path(), None).unwrap_err().to_string();
    assert!(err.contains("'target_hidden_size'"), "{err}");
    // No d2t with a draft vocabulary smaller than the target's.
    let dir = edited_head(|_| {}, Some("d2t"))?;
    let err = load_head(dir.path(), None).unwrap_err().to_string();
    assert!(err.contains("'d2t'") && err.contains("missing"), "{err}");
    // draft_vocab_size that the tensors do not have.
    let dir = edited_head(|c| c["draft_vocab_size"] = 100.into(), None)?;
    let err = load_head(dir.path(), None).unwrap_err().to_string();
    assert!(
        err.contains("lm_head.weight") && err.contains("[100, 64]"),
        "{err}"
    );
    let dir = edited_head(|c| c["draft_vocab_size"] = 600.into(), None)?;
    let err = load_head(dir.path(), None).unwrap_err().to_string();
    assert!(err.contains("'draft_vocab_size'"), "{err}");
    // Aux layers outside the 3-layer target, and no default for 3 layers.
    let dir = edited_head(
        |c| c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = serde_json::json!([0, 1, 3]),
        None,
    )?;
    let err = load_head(dir.path(), None).unwrap_err().to_string();
    assert!(
        err.contains("eagle_aux_hidden_state_layer_ids") && err.contains("layer 3"),
        "{err}"
    );
    let dir = edited_head(
        |c| {
            c.as_object_mut().unwrap().remove("eagle_config");
        },
        None,
    )?;
    let err = load_head(dir.path(), None).unwrap_err().to_string();
    assert!(
        err.contains("eagle_aux_hidden_state_layer_ids") && err.contains("default"),
        "{err}"
    );
    // Head geometry that its tensors do not have.
    let dir = edited_head(|c| c["num_key_value_heads"] = 4.into(), None)?;
    let err = load_head(dir.path(), None).unwrap_err().to_string();
    assert!(
        err.contains("k_proj.weight") && err.contains("[64, 128]"),
        "{err}"
    );
    Ok(())
}

/// The registered `eagle3` speculator with `cfg` over the fixture head.
fn eagle3_drafter(cfg: &SpeculativeConfig) -> R<Box<dyn Speculator>> {
    let registry = Registry::builtin()?;
    let inputs = speculator_inputs(Some(head_dir()))?;
    let drafter = registry.speculators.get("eagle3")?(cfg, &inputs)?;
    assert_eq!(drafter.hidden_layers().len(), 3);
    Ok(drafter)
}

/// The registered `eagle3` speculator with `cfg`, fed the target's states
/// of each reference prompt, drafts up to `max_tokens` for each.
fn eagle3_drafts(cfg: SpeculativeConfig, max_tokens: usize, allow_tree: bool) -> R<Vec<Draft>> {
    propose_on_reference(&mut *eagle3_drafter(&cfg)?, max_tokens, allow_tree)
}

/// The tree tests' settings: three children per node over three levels, ten nodes.
fn tree_config() -> SpeculativeConfig {
    SpeculativeConfig {
        algorithm: "eagle3".into(),
        num_steps: 3,
        num_draft_tokens: 10,
        eagle_topk: 3,
        ..SpeculativeConfig::default()
    }
}

/// The registered `eagle3` speculator, fed the target's states of each
/// reference prompt (all but its last position, whose next token is the
/// prompt's last), proposes the reference's chain: the prefill's last token,
/// then the three chain steps' (positions, state passing and d2t wiring).
#[test]
fn eagle3_drafter_proposes_the_reference_chain() -> R {
    let cfg = SpeculativeConfig {
        algorithm: "eagle3".into(),
        num_steps: 4,
        ..SpeculativeConfig::default()
    };
    let drafts = eagle3_drafts(cfg, 4, false)?;
    for (seq, d) in heads::sequences().iter().zip(&drafts) {
        assert_eq!(d.tokens, reference_chain(&KEYS, seq)?, "EAGLE3 chain");
        assert!(d.parents.is_none());
    }
    Ok(())
}

/// With `eagle_topk` 3 the `eagle3` speculator drafts a valid tree whose
/// greedy path starts with the reference chain: the best first-level node is
/// the prefill's token, and its best child is the first chain step's.
#[test]
fn eagle3_drafter_grows_a_tree_along_the_reference_chain() -> R {
    let drafts = eagle3_drafts(tree_config(), 10, true)?;
    for (seq, d) in heads::sequences().iter().zip(&drafts) {
        d.validate()?;
        let parents = d.parents.as_ref().ok_or("a tree")?;
        assert!(d.len() <= 10 && d.len() > 3, "{d:?}");
        // Three first-level nodes (the top 3 of the kept logits).
        assert_eq!(parents.iter().filter(|p| p.is_none()).count(), 3, "{d:?}");
        let chain = d.first_chain();
        assert_eq!(chain[..2], reference_chain(&KEYS, seq)?[..2], "{d:?}");
    }
    Ok(())
}

/// For a sampled request the `eagle3` tree is drawn: each node's three
/// children are distinct draws from one shared distribution (the head's,
/// filtered by the request's parameters), nodes come breadth-first with
/// whole sibling groups (only the last one cut), and over many seeds the
/// first child of the root follows that distribution.
#[test]
fn eagle3_sampled_trees_are_drawn_from_the_head() -> R {
    let mut drafter = eagle3_drafter(&tree_config())?;
    let params = SamplingParams {
        temperature: 0.7,
        top_k: 20,
        ..SamplingParams::default()
    };
    let rounds = 300;
    let mut first: Vec<std::collections::HashMap<u32, usize>> = Vec::new();
    let mut root_q: Vec<Vec<(f32, u32)>> = Vec::new();
    for round in 0..rounds {
        let drafts =
            propose_sampled_on_reference(&mut *drafter, 10, true, Some((&params, 1000 * round)))?;
        first.resize_with(drafts.len(), Default::default);
        for (k, d) in drafts.iter().enumerate() {
            d.validate()?;
            let parents = d.parents.as_ref().ok_or("a tree")?;
            assert_eq!(d.probs.len(), d.len(), "{d:?}");
            assert_eq!(d.len(), 10, "{d:?}");
            // Breadth-first, siblings together: 3 + 3 + 3 + the first of a group.
            let depth = |mut i: usize| {
                let mut n = 1;
                while let Some(p) = parents[i] {
                    i = p as usize;
                    n += 1;
                }
                n
            };
            let depths: Vec<usize> = (0..d.len()).map(depth).collect();
            assert!(depths.windows(2).all(|w| w[0] <= w[1]), "{depths:?}");
            let mut groups: Vec<(Option<u32>, Vec<usize>)> = Vec::new();
            for (i, p) in parents.iter().enumerate() {
                match groups.last_mut() {
                    Some((q, g)) if q == p => g.push(i),
                    _ => groups.push((*p, vec![i])),
                }
            }
            let sizes: Vec<usize> = groups.iter().map(|g| g.1.len()).collect();
            assert_eq!(sizes, vec![3, 3, 3, 1], "whole sibling groups: {d:?}");
            for (_, g) in &groups {
                let q = &d.probs[g[0]];
                assert!(q.len() <= 20, "top_k 20 filters q");
                let sum: f32 = q.iter().map(|x| x.0).sum();
                assert!((sum - 1.0).abs() < 1e-4, "q sums to {sum}");
                for &i in g {
                    assert!(Arc::ptr_eq(q, &d.probs[i]));
                    assert!(q.iter().any(|x| x.1 == d.tokens[i] && x.0 > 0.0));
                }
            }
            *first[k].entry(d.tokens[0]).or_default() += 1;
            if round == 0 {
                root_q.push(d.probs[0].to_vec());
            } else {
                assert_eq!(
                    root_q[k],
                    d.probs[0][..],
                    "the root's q is the same every round"
                );
            }
        }
    }
    // The root's first child is a plain draw from q: each token within
    // 4.5 standard deviations of its expected count.
    for (counts, q) in first.iter().zip(&root_q) {
        for &(w, t) in q {
            let n = rounds as f64;
            let want = n * f64::from(w);
            let got = counts.get(&t).copied().unwrap_or(0) as f64;
            let sd = (n * f64::from(w) * (1.0 - f64::from(w))).sqrt().max(1.0);
            assert!(
                (got - want).abs() < 4.5 * sd,
                "token {t}: {got} drawn, {want:.1} expected"
            );
        }
    }
    Ok(())
}
