// Samples one token per row of logits, one workgroup of NT invocations per row.
//
// Row parameters (8 words): temperature, top_k, top_p, min_p (f32 bits except
// top_k), seed low and high words, 2 unused. Greedy rows (temperature < 1e-6,
// top_k == 1, or no finite maximum) take the argmax, lowest index first.
// Otherwise w_i = exp((l_i - max) / temperature) (0 for masked logits) is
// stored in `probs`; the kept set is w_i >= max(t_k, t_p, min_p), where t_k is
// the k-th largest w and t_p the largest value whose tail {w >= t_p} holds at
// least top_p of the mass kept by top-k (both found by bisection on the bits of
// w, which order like the values since w >= 0; ties at a threshold are kept).
// The draw u in [0, 1) is a hash of the seed; the token is the first kept id,
// in id order, at which the running mass exceeds u times the kept mass.

struct P {
    rows: u32,
    vocab: u32,
    l_off: u32,
    out_off: u32,
    p_off: u32,
    pad0: u32,
    pad1: u32,
    pad2: u32,
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> logits: array<f32>;
@group(0) @binding(2) var<storage, read> rowp: array<u32>;
@group(0) @binding(3) var<storage, read_write> probs: array<f32>;
@group(0) @binding(4) var<storage, read_write> out: array<u32>;

const NT: u32 = 256u;
const NONE: u32 = 0xffffffffu;
const LOWEST: f32 = -3.4028235e38;

var<workgroup> rf: array<f32, 256>;
var<workgroup> ru: array<u32, 256>;
var<workgroup> scan: array<f32, 256>;

fn sum_f(t: u32, v: f32) -> f32 {
    workgroupBarrier();
    rf[t] = v;
    for (var s = NT / 2u; s > 0u; s = s >> 1u) {
        workgroupBarrier();
        if (t < s) {
            rf[t] = rf[t] + rf[t + s];
        }
    }
    return workgroupUniformLoad(&rf[0]);
}

fn sum_u(t: u32, v: u32) -> u32 {
    workgroupBarrier();
    ru[t] = v;
    for (var s = NT / 2u; s > 0u; s = s >> 1u) {
        workgroupBarrier();
        if (t < s) {
            ru[t] = ru[t] + ru[t + s];
        }
    }
    return workgroupUniformLoad(&ru[0]);
}

fn min_u(t: u32, v: u32) -> u32 {
    workgroupBarrier();
    ru[t] = v;
    for (var s = NT / 2u; s > 0u; s = s >> 1u) {
        workgroupBarrier();
        if (t < s) {
            ru[t] = min(ru[t], ru[t + s]);
        }
    }
    return workgroupUniformLoad(&ru[0]);
}

fn max_u(t: u32, v: u32) -> u32 {
    workgroupBarrier();
    ru[t] = v;
    for (var s = NT / 2u; s > 0u; s = s >> 1u) {
        workgroupBarrier();
        if (t < s) {
            ru[t] = max(ru[t], ru[t + s]);
        }
    }
    return workgroupUniformLoad(&ru[0]);
}

var<workgroup> bc_u: u32;
var<workgroup> bc_f: f32;

// The value every invocation holds, as a uniform value.
fn bcast_u(t: u32, v: u32) -> u32 {
    workgroupBarrier();
    if (t == 0u) {
        bc_u = v;
    }
    return workgroupUniformLoad(&bc_u);
}

fn bcast_f(t: u32, v: f32) -> f32 {
    workgroupBarrier();
    if (t == 0u) {
        bc_f = v;
    }
    return workgroupUniformLoad(&bc_f);
}

fn mix32(x: u32) -> u32 {
    var z = x;
    z = z ^ (z >> 16u);
    z = z * 0x7feb352du;
    z = z ^ (z >> 15u);
    z = z * 0x846ca68bu;
    z = z ^ (z >> 16u);
    return z;
}

// Mass of the w >= thr in probs[base..base+vocab], and how many there are.
fn tail(t: u32, base: u32, thr: u32) -> f32 {
    var s = 0.0;
    for (var i = t; i < p.vocab; i = i + NT) {
        let w = probs[base + i];
        if (bitcast<u32>(w) >= thr) {
            s = s + w;
        }
    }
    return sum_f(t, s);
}

fn count(t: u32, base: u32, thr: u32) -> u32 {
    var c = 0u;
    for (var i = t; i < p.vocab; i = i + NT) {
        if (bitcast<u32>(probs[base + i]) >= thr) {
            c = c + 1u;
        }
    }
    return sum_u(t, c);
}

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let row = wid.y * nwg.x + wid.x;
    if (row >= p.rows) {
        return;
    }
    let t = lid.x;
    let lbase = p.l_off + row * p.vocab;
    let pbase = row * p.vocab;

    // Argmax (lowest index among equal maxima).
    var bv = LOWEST;
    var bi = NONE;
    for (var i = t; i < p.vocab; i = i + NT) {
        let v = logits[lbase + i];
        if (v > bv) {
            bv = v;
            bi = i;
        }
    }
    workgroupBarrier();
    rf[t] = bv;
    ru[t] = bi;
    for (var s = NT / 2u; s > 0u; s = s >> 1u) {
        workgroupBarrier();
        if (t < s) {
            let ov = rf[t + s];
            let oi = ru[t + s];
            if (oi != NONE && (ru[t] == NONE || ov > rf[t] || (ov == rf[t] && oi < ru[t]))) {
                rf[t] = ov;
                ru[t] = oi;
            }
        }
    }
    let best = workgroupUniformLoad(&ru[0]);
    let mx = workgroupUniformLoad(&rf[0]);
    if (best == NONE) {
        // Every logit is masked: the first token, as the host sampler.
        if (t == 0u) {
            out[p.out_off + row] = 0u;
        }
        return;
    }
    let pb = p.p_off + row * 8u;
    let temperature = bcast_f(t, bitcast<f32>(rowp[pb]));
    let k = bcast_u(t, rowp[pb + 1u]);
    let top_p = bcast_f(t, bitcast<f32>(rowp[pb + 2u]));
    let min_p = bitcast<f32>(rowp[pb + 3u]);
    let seed_lo = rowp[pb + 4u];
    let seed_hi = rowp[pb + 5u];
    if (!(temperature >= 1.0e-6) || k == 1u || mx > 3.0e38) {
        if (t == 0u) {
            out[p.out_off + row] = best;
        }
        return;
    }

    // Unnormalized probabilities.
    let inv_t = 1.0 / temperature;
    for (var i = t; i < p.vocab; i = i + NT) {
        let v = logits[lbase + i];
        var w = 0.0;
        if (v > LOWEST) {
            w = exp((v - mx) * inv_t);
        }
        probs[pbase + i] = w;
    }
    storageBarrier();

    // Thresholds as f32 bit patterns.
    var thr = 0u;
    if (k > 0u && k < p.vocab) {
        var lo = 0u;
        var hi = 0x3f800001u;
        loop {
            if (hi - lo <= 1u) {
                break;
            }
            let mid = lo + (hi - lo) / 2u;
            if (count(t, pbase, mid) >= k) {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        thr = lo;
    }
    if (top_p < 1.0) {
        let goal = top_p * tail(t, pbase, thr);
        var lo = thr;
        var hi = 0x3f800001u;
        loop {
            if (hi - lo <= 1u) {
                break;
            }
            let mid = lo + (hi - lo) / 2u;
            if (tail(t, pbase, mid) >= goal) {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        thr = lo;
    }
    if (min_p > 0.0) {
        thr = max(thr, bitcast<u32>(min_p));
    }

    // The draw: chunks of ids in order, an exclusive scan of their kept mass.
    let chunk = (p.vocab + NT - 1u) / NT;
    let c0 = min(t * chunk, p.vocab);
    let c1 = min(c0 + chunk, p.vocab);
    var cs = 0.0;
    var last = NONE;
    for (var i = c0; i < c1; i = i + 1u) {
        let w = probs[pbase + i];
        if (bitcast<u32>(w) >= thr) {
            cs = cs + w;
            last = i;
        }
    }
    workgroupBarrier();
    rf[t] = cs;
    workgroupBarrier();
    if (t == 0u) {
        var run = 0.0;
        for (var i = 0u; i < NT; i = i + 1u) {
            scan[i] = run;
            run = run + rf[i];
        }
        rf[0] = run;
    }
    let total = workgroupUniformLoad(&rf[0]);
    let u = f32(mix32(seed_lo ^ mix32(seed_hi + 0x9e3779b9u)) >> 8u) / 16777216.0;
    let goal = u * total;
    var pick = NONE;
    let start = scan[t];
    if (cs > 0.0 && goal >= start && goal < start + cs) {
        var r = goal - start;
        for (var i = c0; i < c1; i = i + 1u) {
            let w = probs[pbase + i];
            if (bitcast<u32>(w) >= thr) {
                r = r - w;
                if (r < 0.0) {
                    pick = i;
                    break;
                }
            }
        }
        if (pick == NONE) {
            pick = last;
        }
    }
    let chosen = min_u(t, pick);
    let fallback = max_u(t, select(0u, last + 1u, last != NONE));
    if (t == 0u) {
        if (chosen != NONE) {
            out[p.out_off + row] = chosen;
        } else if (fallback > 0u) {
            out[p.out_off + row] = fallback - 1u;
        } else {
            out[p.out_off + row] = best;
        }
    }
}
