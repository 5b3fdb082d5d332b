// dst += src, elementwise over n f32 values.

struct P {
    n: u32,
    src_off: u32,
    dst_off: u32,
    pad: u32,
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> src: array<f32>;
@group(0) @binding(2) var<storage, read_write> dst: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_index(wid, nwg, lid);
    if (i >= p.n) {
        return;
    }
    dst[p.dst_off + i] = dst[p.dst_off + i] + src[p.src_off + i];
}
