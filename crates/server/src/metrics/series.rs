//! The engine's series in the exposition: each a name (after the prefix),
//! a Prometheus type, a help line and a value, grouped as the exposition
//! prints them. A group that is off (structured output, HiCache tiers)
//! prints nothing.

use super::Series;
use arbor_engine_core::engine::EngineStats;
use arbor_engine_core::grammar::GrammarCacheStats;

/// The queues, the grammar cache when structured output is on, and the
/// tokens requests did not compute (jump-forward, a prefill's first token).
pub(super) fn queue(
    s: &EngineStats,
    grammar_queue: usize,
    grammar_cache: Option<GrammarCacheStats>,
) -> Vec<Series> {
    let mut series = vec![
        (
            "num_running_reqs",
            "gauge",
            "The number of running requests.",
            s.num_running_reqs as f64,
        ),
        (
            "num_queue_reqs",
            "gauge",
            "The number of requests in the waiting queue.",
            s.num_queue_reqs as f64,
        ),
        (
            "num_grammar_queue_reqs",
            "gauge",
            "The number of requests waiting for their grammar to compile.",
            grammar_queue as f64,
        ),
    ];
    if let Some(g) = grammar_cache {
        series.extend([
            (
                "grammar_cache_hits_total",
                "counter",
                "Grammar lookups answered by a compiled (or compiling) cache entry.",
                g.hits as f64,
            ),
            (
                "grammar_cache_misses_total",
                "counter",
                "Grammar lookups that started a compilation.",
                g.misses as f64,
            ),
            (
                "grammar_compile_errors_total",
                "counter",
                "Grammar compilations that failed.",
                g.compile_errors as f64,
            ),
        ]);
    }
    series.extend([
        (
            "jump_forward_tokens_total",
            "counter",
            "Number of tokens a grammar forced without a forward pass of their own.",
            s.jump_forward_tokens_total as f64,
        ),
        (
            "given_first_tokens_total",
            "counter",
            "Requests that started from a first token a disaggregated prefill worker sampled.",
            s.given_first_tokens_total as f64,
        ),
    ]);
    series
}

/// Speculative decoding.
pub(super) fn speculative(s: &EngineStats) -> Vec<Series> {
    let rate = if s.spec_draft_tokens_total > 0 {
        s.spec_accepted_tokens_total as f64 / s.spec_draft_tokens_total as f64
    } else {
        0.0
    };
    vec![
        (
            "spec_accept_length",
            "gauge",
            "The average number of tokens per verify step of speculative decoding (accepted drafts + 1).",
            s.spec_accept_length,
        ),
        (
            "spec_accept_rate",
            "gauge",
            "The share of draft tokens the target accepted, since start.",
            rate,
        ),
        (
            "spec_verify_ct_total",
            "counter",
            "Decode steps of requests under speculative decoding.",
            s.spec_verify_ct_total as f64,
        ),
        (
            "spec_draft_tokens_total",
            "counter",
            "Draft tokens proposed and verified.",
            s.spec_draft_tokens_total as f64,
        ),
        (
            "spec_accepted_tokens_total",
            "counter",
            "Draft tokens accepted.",
            s.spec_accepted_tokens_total as f64,
        ),
        (
            "spec_draft_tokens_skipped_total",
            "counter",
            "Draft tokens the adaptive controller did not verify because they would not pay.",
            s.spec_draft_tokens_skipped_total as f64,
        ),
        (
            "spec_draft_budget",
            "gauge",
            "Draft tokens per decoding request in the last step (after the adaptive controller).",
            s.spec_draft_budget,
        ),
    ]
}

/// The KV pool, the prefix cache and the request and token counters.
pub(super) fn pool(s: &EngineStats) -> Vec<Series> {
    vec![
        (
            "num_used_tokens",
            "gauge",
            "The number of KV cache tokens that requests hold (evictable cached tokens excluded).",
            s.num_used_tokens as f64,
        ),
        (
            "evictable_tokens",
            "gauge",
            "The number of KV cache tokens the prefix cache keeps for reuse that no request holds (freed on demand).",
            s.evictable_tokens as f64,
        ),
        (
            "held_tokens",
            "gauge",
            "The number of KV cache tokens held against eviction for open sessions (counted in num_used_tokens).",
            s.held_tokens as f64,
        ),
        (
            "cache_tokens",
            "gauge",
            "The number of KV cache tokens the prefix cache holds (evictable and locked by requests).",
            s.cache_tokens as f64,
        ),
        (
            "max_total_num_tokens",
            "gauge",
            "The KV cache capacity in tokens.",
            s.max_total_tokens as f64,
        ),
        (
            "token_usage",
            "gauge",
            "The fraction of KV cache tokens that requests hold (num_used_tokens / max_total_num_tokens).",
            s.token_usage,
        ),
        (
            "cache_hit_rate",
            "gauge",
            "The prefix cache hit rate over recent prefills.",
            s.cache_hit_rate,
        ),
        (
            "mamba_slots_used",
            "gauge",
            "A hybrid model's recurrent state slots that running requests hold (0 without recurrent layers).",
            s.used_state_slots as f64,
        ),
        (
            "mamba_state_snapshots",
            "gauge",
            "Recurrent state snapshots of cached prefixes kept (a hybrid model's prefix reuse).",
            s.state_snapshots as f64,
        ),
        (
            "gen_throughput",
            "gauge",
            "The generation throughput (token/s).",
            s.gen_throughput,
        ),
        (
            "num_retracted_reqs",
            "gauge",
            "The number of retractions since start.",
            s.num_retracted_reqs_total as f64,
        ),
        (
            "prompt_tokens_total",
            "counter",
            "Number of prefill tokens processed.",
            s.prompt_tokens_total as f64,
        ),
        (
            "generation_tokens_total",
            "counter",
            "Number of generation tokens processed.",
            s.generation_tokens_total as f64,
        ),
        (
            "cached_tokens_total",
            "counter",
            "Number of prompt tokens served from the prefix cache.",
            s.cached_tokens_total as f64,
        ),
        (
            "num_requests_total",
            "counter",
            "Number of requests processed.",
            s.num_requests_total as f64,
        ),
        (
            "num_aborted_requests_total",
            "counter",
            "Number of requests aborted.",
            s.num_aborted_requests_total as f64,
        ),
    ]
}

/// The HiCache series (none when the tiers are off): name, type, help, value.
pub(super) fn hicache(s: &EngineStats) -> Vec<Series> {
    let t = &s.tiers;
    if t.host_capacity_tokens == 0 {
        return Vec::new();
    }
    let c = &s.kv_copy;
    vec![
        (
            "hicache_host_tokens",
            "gauge",
            "Tokens whose KV the host tier holds.",
            t.host_tokens as f64,
        ),
        (
            "hicache_host_capacity_tokens",
            "gauge",
            "Token capacity of the host tier.",
            t.host_capacity_tokens as f64,
        ),
        (
            "hicache_host_hit_tokens_total",
            "counter",
            "Prompt tokens loaded back from the host tier instead of recomputed.",
            t.host_hit_tokens as f64,
        ),
        (
            "hicache_storage_hit_tokens_total",
            "counter",
            "Of those, tokens that had come from the storage tier.",
            t.storage_hit_tokens as f64,
        ),
        (
            "hicache_demoted_tokens_total",
            "counter",
            "Tokens moved from the device to the host tier on eviction.",
            t.demoted_tokens as f64,
        ),
        (
            "hicache_pages_to_host_total",
            "counter",
            "KV pages copied from the device to the host.",
            c.pages_to_host as f64,
        ),
        (
            "hicache_pages_to_device_total",
            "counter",
            "KV pages copied from the host to the device.",
            c.pages_to_device as f64,
        ),
        (
            "hicache_copy_bytes_total",
            "counter",
            "Bytes copied between the device and the host.",
            c.bytes as f64,
        ),
        (
            "hicache_copy_seconds_total",
            "counter",
            "Seconds spent copying KV between the device and the host.",
            c.seconds,
        ),
        (
            "hicache_storage_read_pages_total",
            "counter",
            "KV pages read from the storage tier.",
            t.storage_read_pages as f64,
        ),
        (
            "hicache_storage_read_bytes_total",
            "counter",
            "Bytes read from the storage tier.",
            t.storage_read_bytes as f64,
        ),
        (
            "hicache_storage_read_seconds_total",
            "counter",
            "Seconds spent reading the storage tier (off the scheduler thread).",
            t.storage_read_seconds,
        ),
        (
            "hicache_storage_write_pages_total",
            "counter",
            "KV pages written to the storage tier.",
            t.storage_write_pages as f64,
        ),
        (
            "hicache_storage_write_bytes_total",
            "counter",
            "Bytes written to the storage tier.",
            t.storage_write_bytes as f64,
        ),
        (
            "hicache_storage_write_seconds_total",
            "counter",
            "Seconds spent writing the storage tier (off the scheduler thread).",
            t.storage_write_seconds,
        ),
        (
            "hicache_storage_errors_total",
            "counter",
            "Storage operations that failed (the requests recomputed).",
            t.storage_errors as f64,
        ),
        (
            "hicache_storage_corrupt_total",
            "counter",
            "Stored entries found corrupt, skipped and removed.",
            t.storage_corrupt as f64,
        ),
    ]
}
