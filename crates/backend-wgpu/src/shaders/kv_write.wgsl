// Writes the batch's new K and V rows (f32 [tokens, width]) into their KV
// slots (slot_mapping in the layout words `lay`), converting to the cache type CDT
// (0: f32, one invocation per element; 1: f16 and 2: bf16, one invocation
// per pair of elements packed in a word, width even).

struct P {
    tokens: u32,
    width: u32,
    k_off: u32,   // words
    v_off: u32,   // words
    kc_off: u32,  // words
    vc_off: u32,  // words
    slot_off: u32, // words into lay
    pad: u32,
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> k: array<f32>;
@group(0) @binding(2) var<storage, read> v: array<f32>;
@group(0) @binding(3) var<storage, read> lay: array<u32>;
@group(0) @binding(4) var<storage, read_write> kc: array<{{CT}}>;
@group(0) @binding(5) var<storage, read_write> vc: array<{{CT}}>;

const CDT: u32 = {{CDT}}u;

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
    let per = select(p.width / 2u, p.width, CDT == 0u);
    if (idx >= p.tokens * per) {
        return;
    }
    let t = idx / per;
    let e = idx % per;
    let slot = lay[p.slot_off + t];
    {{BODY}}
}
