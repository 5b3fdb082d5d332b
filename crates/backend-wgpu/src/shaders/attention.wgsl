// Paged attention with grouped-query heads and an optional sliding window,
// one invocation per (token, query head), online softmax over the keys the
// token sees, read from the paged cache (CDT 0: f32, 1: f16, 2: bf16, 3: FP8
// E4M3, 4: FP8 E5M2, four a word, multiplied by k_scale or v_scale). HD is the head dimension (even; a
// multiple of 4 for FP8).
//
// lay (u32, the batch layout): per sequence 4 words at seq_off (q_start, q_len, prefix_len,
// first page-table index); the page table at pt_off; the sequence of each
// token at tok_off; when tree_off is not 0xffffffff, 4 words per token there:
// depth + 1 for a draft-tree token (0 for a chain's), then bits over its
// sequence's new tokens (bit i % 32 of word 1 + i / 32: it sees new token i).
//
// A chain token at position pos sees keys lo..=pos. A tree token at depth d
// (pos = prefix + d) sees the prefix keys from lo, then its ancestors root
// first and itself (new token i sits at prefix + i; its position is prefix +
// its depth, which must be >= lo). Both walk one loop of cache positions
// x with one body, so a tree token's keys come in the order, and with the
// arithmetic, of the same token in a chain of only its ancestors.
//
// Chunks (chunk > 0): a dispatch walks only positions x0 + first ..
// x0 + first + chunk of each token's walk; between dispatches the running
// maximum, sum (their f32 bits) and tree depth stay in st (4 words per
// (token, head)) and the unnormalized accumulator in out, as in registers, so the result
// has the same bits as one walk. llvmpipe (lavapipe) stops every loop of an
// invocation after 65535 iterations in all, which long walks exceed.

struct P {
    tokens: u32,
    heads: u32,
    kv_heads: u32,
    page_size: u32,
    q_off: u32,
    out_off: u32,
    kc_off: u32,
    vc_off: u32,
    seq_off: u32,
    pt_off: u32,
    tok_off: u32,
    window: u32, // 0: none
    scale: f32,
    tree_off: u32, // 0xffffffff: no tree in the batch
    chunk: u32, // 0: the whole walk in one dispatch
    first: u32, // this dispatch's first walk index
    st_off: u32,
    k_scale: f32, // FP8 only: a stored key reads as fp8 * k_scale
    v_scale: f32,
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> q: array<f32>;
@group(0) @binding(2) var<storage, read> lay: array<u32>;
@group(0) @binding(3) var<storage, read> kc: array<{{CT}}>;
@group(0) @binding(4) var<storage, read> vc: array<{{CT}}>;
@group(0) @binding(5) var<storage, read_write> out: array<f32>;
@group(0) @binding(6) var<storage, read_write> st: array<u32>;

const HD: u32 = {{HD}}u;
const CDT: u32 = {{CDT}}u;

// An FP8 byte (CDT 3: E4M3, 4: E5M2) as f32, exactly.
fn fp8_to_f32(c: u32) -> f32 {
    var v: f32;
    if (CDT == 3u) {
        let e = (c >> 3u) & 15u;
        let m = f32(c & 7u);
        if (e == 0u) {
            v = m * 0.001953125;
        } else {
            v = (1.0 + m * 0.125) * bitcast<f32>((e + 120u) << 23u);
        }
    } else {
        let e = (c >> 2u) & 31u;
        let m = f32(c & 3u);
        if (e == 0u) {
            v = m * 0.0000152587890625;
        } else {
            v = (1.0 + m * 0.25) * bitcast<f32>((e + 112u) << 23u);
        }
    }
    return select(v, -v, (c & 0x80u) != 0u);
}

// Elements 2i, 2i+1 of the cache row starting at element `row` (even).
fn kpair(row: u32, i: u32) -> vec2<f32> {
    {{KPAIR}}
}

fn vpair(row: u32, i: u32) -> vec2<f32> {
    {{VPAIR}}
}

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let idx = flat_index(wid, nwg, lid);
    if (idx >= p.tokens * p.heads) {
        return;
    }
    let t = idx / p.heads;
    let h = idx % p.heads;
    let g = h / (p.heads / p.kv_heads);
    let s = lay[p.tok_off + t];
    let q_start = lay[p.seq_off + 4u * s];
    let prefix = lay[p.seq_off + 4u * s + 2u];
    let first_page = lay[p.seq_off + 4u * s + 3u];
    let jl = t - q_start;
    var tree = false;
    var mrow = 0u;
    if (p.tree_off != 0xffffffffu) {
        mrow = p.tree_off + 4u * t;
        tree = lay[mrow] != 0u;
    }
    var pos = prefix + jl;
    if (tree) {
        pos = prefix + lay[mrow] - 1u;
    }
    var lo = 0u;
    if (p.window > 0u && pos + 1u > p.window) {
        lo = pos + 1u - p.window;
    }
    // Cache positions walked: x0..x1 (a tree skips what the token does not see).
    var x0 = lo;
    var x1 = pos + 1u;
    if (tree) {
        x0 = min(lo, prefix);
        x1 = prefix + jl + 1u;
    }
    var depth = 0u;
    let ob = p.out_off + t * p.heads * HD + h * HD;
    let sb = p.st_off + 4u * idx;
    let walk_end = x1;
    if (p.chunk > 0u) {
        let begin = x0 + p.first;
        if (begin >= walk_end) {
            return;
        }
        x0 = begin;
        x1 = min(walk_end, begin + p.chunk);
    }
    let resume = p.chunk > 0u && p.first > 0u;
    let qb = p.q_off + t * p.heads * HD + h * HD;
    var qv: array<vec2<f32>, HD / 2u>;
    var acc: array<vec2<f32>, HD / 2u>;
    for (var i = 0u; i < HD / 2u; i = i + 1u) {
        qv[i] = vec2<f32>(q[qb + 2u * i], q[qb + 2u * i + 1u]);
    }
    var mx = -1.0e30;
    var l = 0.0;
    if (resume) {
        mx = bitcast<f32>(st[sb]);
        l = bitcast<f32>(st[sb + 1u]);
        depth = st[sb + 2u];
        for (var i = 0u; i < HD / 2u; i = i + 1u) {
            acc[i] = vec2<f32>(out[ob + 2u * i], out[ob + 2u * i + 1u]);
        }
    }
    for (var j = x0; j < x1; j = j + 1u) {
        if (tree && j >= prefix) {
            let i = j - prefix;
            if (((lay[mrow + 1u + i / 32u] >> (i % 32u)) & 1u) == 0u) {
                continue;
            }
            // An ancestor (or the token): its depth is the count met before it.
            let d = depth;
            depth = depth + 1u;
            if (prefix + d < lo) {
                continue;
            }
        }
        let page = lay[p.pt_off + first_page + j / p.page_size];
        let slot = page * p.page_size + j % p.page_size;
        let row = (slot * p.kv_heads + g) * HD;
        var sc = 0.0;
        for (var i = 0u; i < HD / 2u; i = i + 1u) {
            sc = sc + dot(qv[i], kpair(row, i));
        }
        sc = sc * p.scale;
        let m_new = max(mx, sc);
        let c = exp(mx - m_new);
        let e = exp(sc - m_new);
        l = l * c + e;
        for (var i = 0u; i < HD / 2u; i = i + 1u) {
            acc[i] = acc[i] * c + e * vpair(row, i);
        }
        mx = m_new;
    }
    if (x1 < walk_end) {
        st[sb] = bitcast<u32>(mx);
        st[sb + 1u] = bitcast<u32>(l);
        st[sb + 2u] = depth;
        for (var i = 0u; i < HD / 2u; i = i + 1u) {
            out[ob + 2u * i] = acc[i].x;
            out[ob + 2u * i + 1u] = acc[i].y;
        }
        return;
    }
    let inv = 1.0 / l;
    for (var i = 0u; i < HD / 2u; i = i + 1u) {
        out[ob + 2u * i] = acc[i].x * inv;
        out[ob + 2u * i + 1u] = acc[i].y * inv;
    }
}
