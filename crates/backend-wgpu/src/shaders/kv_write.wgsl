// Writes the batch's new K and V rows (f32 [tokens, width]) into their KV
// slots (slot_mapping in the layout words `lay`), converting to the cache type CDT
// (0: f32, one invocation per element; 1: f16 and 2: bf16, one invocation
// per pair of elements packed in a word, width even; 3: FP8 E4M3 and 4: FP8
// E5M2 of the rows divided by the layer's k_scale and v_scale, rounding to
// nearest even and saturating as the CPU backend does, one invocation per
// four elements, width a multiple of 4).

struct P {
    tokens: u32,
    width: u32,
    k_off: u32,   // words
    v_off: u32,   // words
    kc_off: u32,  // words
    vc_off: u32,  // words
    slot_off: u32, // words into lay
    pad: u32,
    k_scale: f32, // FP8 only: stored = fp8(k / k_scale)
    v_scale: f32,
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> k: array<f32>;
@group(0) @binding(2) var<storage, read> v: array<f32>;
@group(0) @binding(3) var<storage, read> lay: array<u32>;
@group(0) @binding(4) var<storage, read_write> kc: array<{{CT}}>;
@group(0) @binding(5) var<storage, read_write> vc: array<{{CT}}>;

const CDT: u32 = {{CDT}}u;

// a * 2^-e, exact (a power-of-two scaling).
fn times_pow2(a: f32, e: i32) -> f32 {
    return a * bitcast<f32>(u32(127 - e) << 23u);
}

// f32 -> FP8 (CDT 3: E4M3, saturating at 448; 4: E5M2, saturating at 57344).
fn to_fp8(v: f32) -> u32 {
    let sign = (bitcast<u32>(v) >> 24u) & 0x80u;
    let a = abs(v);
    let e4 = CDT == 3u;
    if (a != a) {
        return select(0x7eu, 0x7fu, e4);
    }
    let max_v = select(57344.0, 448.0, e4);
    if (a >= max_v) {
        return sign | select(0x7bu, 0x7eu, e4);
    }
    let mbits = select(2u, 3u, e4);
    let bias = select(15, 7, e4);
    // Below the smallest normal the codes step by 2^(1 - bias - mbits).
    let min_normal = bitcast<f32>(u32(128 - bias) << 23u);
    if (a < min_normal) {
        return sign | u32(round(times_pow2(a, 1 - bias - i32(mbits))));
    }
    var e = i32((bitcast<u32>(a) >> 23u) & 0xffu) - 127;
    let frac = times_pow2(a, e);
    var m = u32(round((frac - 1.0) * f32(1u << mbits)));
    if (m == (1u << mbits)) {
        m = 0u;
        e = e + 1;
    }
    let code = (u32(e + bias) << mbits) | m;
    return sign | min(code, select(0x7bu, 0x7eu, e4));
}

fn pack4(a: f32, b: f32, c: f32, d: f32, s: f32) -> u32 {
    return to_fp8(a / s) | (to_fp8(b / s) << 8u) | (to_fp8(c / s) << 16u) | (to_fp8(d / s) << 24u);
}

fn pack(a: f32, b: f32) -> u32 {
    if (CDT == 1u) {
        return f32_to_f16_bits(a) | (f32_to_f16_bits(b) << 16u);
    }
    return f32_to_bf16_bits(a) | (f32_to_bf16_bits(b) << 16u);
}

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let idx = flat_index(wid, nwg, lid);
    var per = select(p.width / 2u, p.width, CDT == 0u);
    if (CDT >= 3u) {
        per = p.width / 4u;
    }
    if (idx >= p.tokens * per) {
        return;
    }
    let t = idx / per;
    let e = idx % per;
    let slot = lay[p.slot_off + t];
    {{BODY}}
}
