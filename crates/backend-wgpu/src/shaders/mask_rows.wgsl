// Grammar masks of logits rows (engine-core's `logit_edits`): one invocation
// per (masked row, token); a token whose bit is clear becomes -inf. Masks are
// `words` words each (bit t % 32 of word t / 32), in the order of `rows`.

struct P {
    n: u32,
    vocab: u32,
    words: u32,
    l_off: u32,
    r_off: u32,
    m_off: u32,
    pad0: u32,
    pad1: u32,
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read_write> logits: array<f32>;
@group(0) @binding(2) var<storage, read> rows: array<u32>;
@group(0) @binding(3) var<storage, read> masks: array<u32>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let idx = flat_index(wid, nwg, lid);
    if (idx >= p.n * p.vocab) {
        return;
    }
    let k = idx / p.vocab;
    let t = idx % p.vocab;
    let w = masks[p.m_off + k * p.words + t / 32u];
    if (((w >> (t % 32u)) & 1u) == 0u) {
        logits[p.l_off + rows[p.r_off + k] * p.vocab + t] = bitcast<f32>(0xff800000u);
    }
}
