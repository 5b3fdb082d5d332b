// out = x * sigmoid(gate), elementwise over n f32 values (gated attention's output gate).

struct P {
    n: u32,
    g_off: u32,
    x_off: u32,
    out_off: u32,
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> gate: array<f32>;
@group(0) @binding(2) var<storage, read> x: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_index(wid, nwg, lid);
    if (i >= p.n) {
        return;
    }
    out[p.out_off + i] = x[p.x_off + i] / (1.0 + exp(-gate[p.g_off + i]));
}
