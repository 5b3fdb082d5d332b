// A Gated DeltaNet layer's recurrence (engine-core's backend/recurrent.rs is the reference; the
// CUDA kernel backend-gpu/kernels/recurrent.cu the same algorithm): one workgroup per
// (sequence, query/key head group). Per token, in order: each invocation convolves its channels
// of the group (causal depthwise convolution with SiLU over the slot's `kernel - 1` past inputs,
// then shifted), invocation 0 sums the squares of the query and key heads (fixed order), and each
// invocation updates its columns of the value heads' states in place (decay, kv_mem = S^T k,
// delta = (v - kv_mem) * beta, S += k (x) delta, o = S^T q). Every token runs the same operations
// in the same order whatever the batch. A fresh sequence starts from zero state; snapshots copy
// the state after the sequence's first `n` tokens (of this dispatch) into another slot.
//
// `ab` holds `a` ([t, v_heads]) then `b`; `adt` holds A_log then dt_bias; `table` holds 6 words
// per sequence (first row, rows, slot, fresh, first snapshot, snapshots) then (n, slot) pairs.

struct P {
    mixed_off: u32,
    ab_off: u32,
    w_off: u32,
    adt_off: u32,
    cs_off: u32,
    rs_off: u32,
    out_off: u32,
    table_off: u32,
    channels: u32,
    kernel: u32,
    k_heads: u32,
    v_heads: u32,
    dk: u32,
    dv: u32,
    tokens: u32,
    seqs: u32,
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> mixed: array<f32>;
@group(0) @binding(2) var<storage, read> ab: array<f32>;
@group(0) @binding(3) var<storage, read> conv_w: array<f32>;
@group(0) @binding(4) var<storage, read> adt: array<f32>;
@group(0) @binding(5) var<storage, read_write> cs: array<f32>;
@group(0) @binding(6) var<storage, read_write> rs: array<f32>;
@group(0) @binding(7) var<storage, read_write> out: array<f32>;
@group(0) @binding(8) var<storage, read> table: array<u32>;

// The group's convolved queries, keys and values of one token, then the two inverse norms.
var<workgroup> x: array<f32, 2050>;
var<workgroup> token_count: u32;

// Group `kh`'s channel `c` (queries, keys, then values) as a channel of the projection.
fn channel(c: u32, kh: u32, g: u32) -> u32 {
    if (c < p.dk) {
        return kh * p.dk + c;
    }
    if (c < 2u * p.dk) {
        return p.k_heads * p.dk + kh * p.dk + (c - p.dk);
    }
    return 2u * p.k_heads * p.dk + kh * g * p.dv + (c - 2u * p.dk);
}

fn softplus(v: f32) -> f32 {
    if (v > 20.0) {
        return v;
    }
    return log(1.0 + exp(v));
}

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let tid = lid.x;
    let s = p.table_off + 6u * wid.x;
    let row0 = table[s];
    let slot = table[s + 2u];
    let fresh = table[s + 3u] != 0u;
    let snap0 = p.table_off + 6u * p.seqs + 2u * table[s + 4u];
    let nsnap = table[s + 5u];
    if (tid == 0u) {
        token_count = table[s + 1u];
    }
    let n = workgroupUniformLoad(&token_count);
    let kh = wid.y;
    let g = p.v_heads / p.k_heads;
    let past = p.kernel - 1u;
    let gch = 2u * p.dk + g * p.dv;
    let cols = g * p.dv;
    let conv_len = p.channels * past;
    let rec_len = p.v_heads * p.dk * p.dv;
    let cbase = p.cs_off + slot * conv_len;
    let rbase = p.rs_off + slot * rec_len;
    if (fresh) {
        for (var c = tid; c < gch; c = c + WG) {
            let st = cbase + channel(c, kh, g) * past;
            for (var q = 0u; q < past; q = q + 1u) {
                cs[st + q] = 0.0;
            }
        }
        for (var col = tid; col < cols; col = col + WG) {
            let h = col / p.dv;
            let base = rbase + (kh * g + h) * p.dk * p.dv + (col - h * p.dv);
            for (var r = 0u; r < p.dk; r = r + 1u) {
                rs[base + r * p.dv] = 0.0;
            }
        }
    }
    let scale = 1.0 / sqrt(f32(p.dk));
    for (var i = 0u; i < n; i = i + 1u) {
        let row = row0 + i;
        for (var c = tid; c < gch; c = c + WG) {
            let ch = channel(c, kh, g);
            let st = cbase + ch * past;
            let w = p.w_off + ch * p.kernel;
            let cur = mixed[p.mixed_off + row * p.channels + ch];
            var acc = 0.0;
            for (var q = 0u; q < past; q = q + 1u) {
                acc = acc + conv_w[w + q] * cs[st + q];
            }
            acc = acc + conv_w[w + past] * cur;
            x[c] = acc / (1.0 + exp(-acc));
            for (var q = 0u; q + 1u < past; q = q + 1u) {
                cs[st + q] = cs[st + q + 1u];
            }
            cs[st + past - 1u] = cur;
            for (var k = 0u; k < nsnap; k = k + 1u) {
                if (table[snap0 + 2u * k] == i + 1u) {
                    let d = p.cs_off + table[snap0 + 2u * k + 1u] * conv_len + ch * past;
                    for (var q = 0u; q < past; q = q + 1u) {
                        cs[d + q] = cs[st + q];
                    }
                }
            }
        }
        workgroupBarrier();
        if (tid == 0u) {
            var sq = 0.0;
            var sk = 0.0;
            for (var r = 0u; r < p.dk; r = r + 1u) {
                sq = sq + x[r] * x[r];
            }
            for (var r = 0u; r < p.dk; r = r + 1u) {
                sk = sk + x[p.dk + r] * x[p.dk + r];
            }
            x[gch] = 1.0 / sqrt(sq + 1e-6) * scale;
            x[gch + 1u] = 1.0 / sqrt(sk + 1e-6);
        }
        workgroupBarrier();
        let qn = x[gch];
        let kn = x[gch + 1u];
        for (var col = tid; col < cols; col = col + WG) {
            let h = col / p.dv;
            let j = col - h * p.dv;
            let vh = kh * g + h;
            let a_neg = -exp(adt[p.adt_off + vh]);
            let av = ab[p.ab_off + row * p.v_heads + vh];
            let decay = exp(a_neg * softplus(av + adt[p.adt_off + p.v_heads + vh]));
            let bx = ab[p.ab_off + (p.tokens + row) * p.v_heads + vh];
            let beta = 1.0 / (1.0 + exp(-bx));
            let base = rbase + vh * p.dk * p.dv + j;
            var mem = 0.0;
            for (var r = 0u; r < p.dk; r = r + 1u) {
                let sv = rs[base + r * p.dv] * decay;
                rs[base + r * p.dv] = sv;
                mem = mem + sv * (x[p.dk + r] * kn);
            }
            let d = (x[2u * p.dk + h * p.dv + j] - mem) * beta;
            var o = 0.0;
            for (var r = 0u; r < p.dk; r = r + 1u) {
                let sv = rs[base + r * p.dv] + (x[p.dk + r] * kn) * d;
                rs[base + r * p.dv] = sv;
                o = o + sv * (x[r] * qn);
            }
            out[p.out_off + row * p.v_heads * p.dv + vh * p.dv + j] = o;
            for (var k = 0u; k < nsnap; k = k + 1u) {
                if (table[snap0 + 2u * k] == i + 1u) {
                    let dst = p.rs_off + table[snap0 + 2u * k + 1u] * rec_len + vh * p.dk * p.dv + j;
                    for (var r = 0u; r < p.dk; r = r + 1u) {
                        rs[dst + r * p.dv] = rs[base + r * p.dv];
                    }
                }
            }
        }
        workgroupBarrier();
    }
}
