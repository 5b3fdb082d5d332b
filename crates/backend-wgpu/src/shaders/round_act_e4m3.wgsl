// Rounds f32 activation rows to E4M3 for W8A8 FP8 weights (f8a8_s32), as
// arbor-quant's scaled::round_input_e4m3: each run of 32 values of a row
// becomes its E4M3 codes of v * (448 / amax) (nearest even, saturating at
// 448) times the scale amax / 448, or with a static input scale (scale > 0,
// inv its reciprocal computed on the host) the codes of v * inv times
// scale, written as f32 to a dense [rows, k] buffer. One invocation per run.

struct P {
    blocks: u32,
    blocks_per_row: u32,
    x_off: u32,
    ldx: u32, // words between rows of x
    inv: f32,
    scale: f32,
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;

// The E4M3 value nearest to v (ties to even), saturating at +-448.
fn round_e4m3(v: f32) -> f32 {
    let a = abs(v);
    var r: f32;
    if (a >= 448.0) {
        r = 448.0;
    } else if (a < 0.015625) {
        // Below the smallest normal (2^-6) the values step by 2^-9.
        r = round(a * 512.0) * 0.001953125;
    } else {
        let e = i32((bitcast<u32>(a) >> 23u) & 0xffu) - 127;
        // Three mantissa bits: steps of 2^(e - 3), exact power-of-two scalings.
        let step = bitcast<f32>(u32(e - 3 + 127) << 23u);
        let inv = bitcast<f32>(u32(127 - e + 3) << 23u);
        r = round(a * inv) * step;
    }
    return select(r, -r, v < 0.0);
}

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let b = flat_index(wid, nwg, lid);
    if (b >= p.blocks) {
        return;
    }
    let row = b / p.blocks_per_row;
    let base = p.x_off + row * p.ldx + (b % p.blocks_per_row) * 32u;
    var inv = p.inv;
    var scale = p.scale;
    if (scale <= 0.0) {
        var amax = 0.0;
        for (var j = 0u; j < 32u; j = j + 1u) {
            amax = max(amax, abs(x[base + j]));
        }
        inv = 0.0;
        if (amax > 0.0) {
            inv = 448.0 / amax;
        }
        scale = amax / 448.0;
    }
    for (var j = 0u; j < 32u; j = j + 1u) {
        y[b * 32u + j] = round_e4m3(x[base + j] * inv) * scale;
    }
}
