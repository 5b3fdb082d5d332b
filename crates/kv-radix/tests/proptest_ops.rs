//! Property tests: arbitrary op sequences (shrunk on failure) keep the cache
//! equal to the naive model and every invariant intact, and end with the
//! pool whole after flush.

mod common;

use common::{Harness, Op, SeqSpec};
use proptest::prelude::*;

fn seq() -> impl Strategy<Value = SeqSpec> {
    (0usize..1000, 0usize..1000, 0usize..16, any::<u64>()).prop_map(|(base, keep, extra, seed)| {
        SeqSpec {
            base,
            keep,
            extra,
            seed,
        }
    })
}

fn op() -> impl Strategy<Value = Op> {
    let ns = prop_oneof![4 => Just(0usize), 1 => 1usize..3];
    prop_oneof![
        5 => (ns.clone(), seq()).prop_map(|(ns, seq)| Op::Admit { ns, seq }),
        2 => (0usize..50, 1usize..5).prop_map(|(req, pages)| Op::Chunk { req, pages }),
        4 => (0usize..50, -2i64..3).prop_map(|(req, priority)| Op::Finish { req, priority }),
        1 => (0usize..50).prop_map(|req| Op::Abort { req }),
        3 => (ns.clone(), seq(), -2i64..3)
            .prop_map(|(ns, seq, priority)| Op::Insert { ns, seq, priority }),
        2 => (ns, seq()).prop_map(|(ns, seq)| Op::Match { ns, seq }),
        2 => (0usize..20).prop_map(|tokens| Op::Evict { tokens }),
        1 => Just(Op::Flush),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn ops_match_the_model(
        policy in prop::sample::select(arbor_kv_radix::POLICY_NAMES.to_vec()),
        ps in 1usize..4,
        alphabet in 2u32..5,
        ops in prop::collection::vec(op(), 1..120),
    ) {
        let mut h = Harness::new(policy, ps, 32, alphabet);
        for op in &ops {
            h.apply(op);
            h.check();
        }
        h.finish();
    }

    #[test]
    fn evict_frees_at_least_what_is_asked(
        ops in prop::collection::vec(op(), 1..60),
        ask in 0usize..200,
    ) {
        let mut h = Harness::new("lru", 2, 64, 3);
        for op in &ops {
            h.apply(op);
        }
        use arbor_engine_core::PrefixCache;
        let before = h.cache.stats();
        let freed = h.cache.evict(ask);
        let after = h.cache.stats();
        prop_assert_eq!(after.cached_tokens + freed, before.cached_tokens);
        prop_assert_eq!(after.protected_tokens, before.protected_tokens);
        prop_assert!(freed >= ask.min(before.evictable_tokens));
        prop_assert!(h.cache.check_invariants().is_ok());
    }
}
