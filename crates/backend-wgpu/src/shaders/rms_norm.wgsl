// Row-wise RMSNorm, one workgroup per row. With ADD, first residual += x and
// normalize the sum (the residual is written back).
//   plain: out = x / rms(x) * w
//   add:   res += x; out = res / rms(res) * w

struct P {
    rows: u32,
    dim: u32,
    x_off: u32,
    w_off: u32,
    out_off: u32,
    res_off: u32,
    eps: f32,
    pad: u32,
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> w: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
{{RES_DECL}}

const ADD: bool = {{ADD}};

var<workgroup> partial: array<f32, 64>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let row = wid.y * nwg.x + wid.x;
    let t = lid.x;
    let live = row < p.rows;
    let r = min(row, p.rows - 1u);
    var ss = 0.0;
    for (var j = t; j < p.dim; j = j + WG) {
        var v = x[p.x_off + r * p.dim + j];
        {{ADD_STEP}}
        ss = ss + v * v;
    }
    partial[t] = ss;
    workgroupBarrier();
    for (var s = 32u; s > 0u; s = s >> 1u) {
        if (t < s) {
            partial[t] = partial[t] + partial[t + s];
        }
        workgroupBarrier();
    }
    let scale = 1.0 / sqrt(partial[0] / f32(p.dim) + p.eps);
    if (!live) {
        return;
    }
    for (var j = t; j < p.dim; j = j + WG) {
        {{LOAD_NORMED}}
        out[p.out_off + r * p.dim + j] = v * scale * w[p.w_off + j];
    }
}
