// Token edits of logits rows (engine-core's `logit_edits`), one invocation per
// edit. An edit is 6 words: row, token (bit 31: forbidden), then the f32 bits
// of pos_scale, neg_scale, penalty and bias. The logit x becomes -inf when
// forbidden, else (x * (x > 0 ? pos_scale : neg_scale) - penalty) + bias, one
// correctly rounded operation at a time (each result is stored and loaded
// back, so nothing is fused into an fma): the host's bits. Edits of one
// launch touch distinct (row, token) pairs.

struct P {
    n: u32,
    vocab: u32,
    l_off: u32,
    e_off: u32,
    pad0: u32,
    pad1: u32,
    pad2: u32,
    pad3: u32,
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read_write> logits: array<f32>;
@group(0) @binding(2) var<storage, read> edits: array<u32>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_index(wid, nwg, lid);
    if (i >= p.n) {
        return;
    }
    let e = p.e_off + 6u * i;
    let tw = edits[e + 1u];
    let at = p.l_off + edits[e] * p.vocab + (tw & 0x7fffffffu);
    if ((tw >> 31u) != 0u) {
        logits[at] = bitcast<f32>(0xff800000u);
        return;
    }
    let x = logits[at];
    var scale = bitcast<f32>(edits[e + 3u]);
    if (x > 0.0) {
        scale = bitcast<f32>(edits[e + 2u]);
    }
    logits[at] = x * scale;
    logits[at] = logits[at] - bitcast<f32>(edits[e + 4u]);
    logits[at] = logits[at] + bitcast<f32>(edits[e + 5u]);
}
