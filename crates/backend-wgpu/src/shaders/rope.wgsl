// Rotary embedding in place on x [tokens, heads * head_dim]; one invocation
// per (token, head, frequency). STYLE 0: Neox (halves), 1: interleaved pairs.

struct P {
    tokens: u32,
    width: u32,
    head_dim: u32,
    half: u32,
    x_off: u32,
    pos_off: u32,
    freq_off: u32,
    style: u32,
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read> pos: array<u32>;
@group(0) @binding(3) var<storage, read> freq: array<f32>;

// 2*pi split so that k * C1 is exact for the arguments of any context length.
const C1: f32 = 6.28125;
const C2: f32 = 0.0019353071795864769;
const INV_2PI: f32 = 0.15915494309189535;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let idx = flat_index(wid, nwg, lid);
    let heads = p.width / p.head_dim;
    if (idx >= p.tokens * heads * p.half) {
        return;
    }
    let i = idx % p.half;
    let th = idx / p.half;
    let h = th % heads;
    let t = th / heads;
    let a = f32(pos[p.pos_off + t]) * freq[p.freq_off + i];
    let k = round(a * INV_2PI);
    let r = (a - k * C1) - k * C2;
    let c = cos(r);
    let s = sin(r);
    let base = p.x_off + t * p.width + h * p.head_dim;
    var i0 = base + i;
    var i1 = base + i + p.half;
    if (p.style == 1u) {
        i0 = base + 2u * i;
        i1 = i0 + 1u;
    }
    let x0 = x[i0];
    let x1 = x[i1];
    x[i0] = x0 * c - x1 * s;
    x[i1] = x1 * c + x0 * s;
}
