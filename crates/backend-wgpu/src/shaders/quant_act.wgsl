// Quantizes f32 activation rows to Q8 blocks of 32, as ggml's x86
// quantize_row_q8_0/q8_1 (and arbor-quant's PreparedActs): scale 127/amax,
// round half to even, scale stored f16-rounded. One invocation per block.
// Output: qs (8 words of packed i8 per block) and qmeta (4 f32 per block:
// d, s = f16(amax/127 * sum(q)) (Q8_1's s), sum(q), 0).

struct P {
    blocks: u32,
    blocks_per_row: u32,
    x_off: u32,
    ldx: u32, // words between rows of x
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> qs: array<u32>;
@group(0) @binding(3) var<storage, read_write> qmeta: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let b = flat_index(wid, nwg, lid);
    if (b >= p.blocks) {
        return;
    }
    let row = b / p.blocks_per_row;
    let base = p.x_off + row * p.ldx + (b % p.blocks_per_row) * 32u;
    var amax = 0.0;
    for (var j = 0u; j < 32u; j = j + 1u) {
        amax = max(amax, abs(x[base + j]));
    }
    var id = 0.0;
    if (amax != 0.0) {
        id = 127.0 / amax;
    }
    var sum = 0;
    for (var w = 0u; w < 8u; w = w + 1u) {
        var word = 0u;
        for (var e = 0u; e < 4u; e = e + 1u) {
            let q = i32(clamp(round(x[base + 4u * w + e] * id), -127.0, 127.0));
            sum = sum + q;
            word = word | ((bitcast<u32>(q) & 0xffu) << (8u * e));
        }
        qs[b * 8u + w] = word;
    }
    let d = amax / 127.0;
    qmeta[b * 4u] = round_f16(d);
    qmeta[b * 4u + 1u] = round_f16(d * f32(sum));
    qmeta[b * 4u + 2u] = f32(sum);
    qmeta[b * 4u + 3u] = 0.0;
}
