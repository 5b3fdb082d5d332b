// out[i, j] = dequantize(table[ids[i], j]) for a table in DT
// (0 f32, 1 f16, 2 bf16, 3 q8_0, 4 q4_0, 5 q4_1). One invocation per element.
// Ids outside the table produce zero rows.

struct P {
    n: u32,
    dim: u32,
    vocab: u32,
    row_bytes: u32,
    table_off: u32, // bytes
    ids_off: u32,   // words
    out_off: u32,   // words
    pad: u32,
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> table: array<u32>;
@group(0) @binding(2) var<storage, read> ids: array<u32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

const DT: u32 = {{DT}}u;

fn ld_u16(b: u32) -> u32 {
    return (table[b >> 2u] >> ((b & 2u) * 8u)) & 0xffffu;
}

fn ld_u8(b: u32) -> u32 {
    return (table[b >> 2u] >> ((b & 3u) * 8u)) & 0xffu;
}

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let idx = flat_index(wid, nwg, lid);
    if (idx >= p.n * p.dim) {
        return;
    }
    let i = idx / p.dim;
    let j = idx % p.dim;
    let id = ids[p.ids_off + i];
    var v = 0.0;
    if (id < p.vocab) {
        let base = p.table_off + id * p.row_bytes;
        if (DT == 0u) {
            v = bitcast<f32>(table[(base >> 2u) + j]);
        } else if (DT == 1u) {
            v = f16_bits_to_f32(ld_u16(base + 2u * j));
        } else if (DT == 2u) {
            v = bf16_bits_to_f32(ld_u16(base + 2u * j));
        } else if (DT == 3u) {
            let bb = base + (j / 32u) * 34u;
            let d = f16_bits_to_f32(ld_u16(bb));
            v = f32(sext8(ld_u8(bb + 2u + j % 32u))) * d;
        } else if (DT == 4u) {
            let bb = base + (j / 32u) * 18u;
            let d = f16_bits_to_f32(ld_u16(bb));
            let q = j % 32u;
            let byte = ld_u8(bb + 2u + q % 16u);
            let nib = select(byte & 15u, byte >> 4u, q >= 16u);
            v = f32(i32(nib) - 8) * d;
        } else {
            let bb = base + (j / 32u) * 20u;
            let d = f16_bits_to_f32(ld_u16(bb));
            let m = f16_bits_to_f32(ld_u16(bb + 2u));
            let q = j % 32u;
            let byte = ld_u8(bb + 4u + q % 16u);
            let nib = select(byte & 15u, byte >> 4u, q >= 16u);
            v = f32(nib) * d + m;
        }
    }
    out[p.out_off + idx] = v;
}
