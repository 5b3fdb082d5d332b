// out[i, :] = x[rows[i], :] for f32 rows of dim values; rows past the input
// (x_rows) produce zeros.

struct P {
    n: u32,
    dim: u32,
    x_rows: u32,
    x_off: u32,
    rows_off: u32,
    out_off: u32,
    pad0: u32,
    pad1: u32,
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> rows: array<u32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let idx = flat_index(wid, nwg, lid);
    if (idx >= p.n * p.dim) {
        return;
    }
    let i = idx / p.dim;
    let j = idx % p.dim;
    let r = rows[p.rows_off + i];
    var v = 0.0;
    if (r < p.x_rows) {
        v = x[p.x_off + r * p.dim + j];
    }
    out[p.out_off + idx] = v;
}
