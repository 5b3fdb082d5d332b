// Log-probability statistics of logits rows, one workgroup of NT invocations
// per row: the row's log-sum-exp (m + log(sum(exp(x - m))) from its largest
// value m; m itself when m is not finite), then its `top` largest logits as
// (id, logit - lse), largest first and the lower id first among equal values:
// pick k is the best (value, id) strictly after pick k - 1 in that order, so
// no list of earlier picks is kept. NaN logits are never picked.

struct P {
    rows: u32,
    vocab: u32,
    top: u32,
    l_off: u32,
    lse_off: u32,
    ids_off: u32,
    vals_off: u32,
    pad0: u32,
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> logits: array<f32>;
@group(0) @binding(2) var<storage, read_write> lse: array<f32>;
@group(0) @binding(3) var<storage, read_write> ids: array<u32>;
@group(0) @binding(4) var<storage, read_write> vals: array<f32>;

const NT: u32 = 256u;
const NONE: u32 = 0xffffffffu;

var<workgroup> rf: array<f32, 256>;
var<workgroup> ru: array<u32, 256>;

// (v, i) is a better pick than (w, j): any pick beats none; then the larger
// value, then the lower id.
fn better(v: f32, i: u32, w: f32, j: u32) -> bool {
    return j == NONE || (i != NONE && (v > w || (v == w && i < j)));
}

fn max_f(t: u32, v: f32) -> f32 {
    workgroupBarrier();
    rf[t] = v;
    for (var s = NT / 2u; s > 0u; s = s >> 1u) {
        workgroupBarrier();
        if (t < s) {
            rf[t] = max(rf[t], rf[t + s]);
        }
    }
    return workgroupUniformLoad(&rf[0]);
}

fn sum_f(t: u32, v: f32) -> f32 {
    workgroupBarrier();
    rf[t] = v;
    for (var s = NT / 2u; s > 0u; s = s >> 1u) {
        workgroupBarrier();
        if (t < s) {
            rf[t] = rf[t] + rf[t + s];
        }
    }
    return workgroupUniformLoad(&rf[0]);
}

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let row = wid.y * nwg.x + wid.x;
    if (row >= p.rows) {
        return;
    }
    let t = lid.x;
    let base = p.l_off + row * p.vocab;
    let neg_inf = bitcast<f32>(0xff800000u);
    var m = neg_inf;
    for (var i = t; i < p.vocab; i = i + NT) {
        let x = logits[base + i];
        if (x > m) {
            m = x;
        }
    }
    m = max_f(t, m);
    var s = 0.0;
    let finite = (bitcast<u32>(m) & 0x7f800000u) != 0x7f800000u;
    if (finite) {
        for (var i = t; i < p.vocab; i = i + NT) {
            s = s + exp(logits[base + i] - m);
        }
    }
    s = sum_f(t, s);
    var l = m;
    if (finite) {
        l = m + log(s);
    }
    if (t == 0u) {
        lse[p.lse_off + row] = l;
    }
    var pv = 0.0;
    var pid = NONE;
    for (var k = 0u; k < p.top; k = k + 1u) {
        var bv = neg_inf;
        var bi = NONE;
        for (var i = t; i < p.vocab; i = i + NT) {
            let x = logits[base + i];
            let after = k == 0u || x < pv || (x == pv && i > pid);
            if (after && x == x && better(x, i, bv, bi)) {
                bv = x;
                bi = i;
            }
        }
        workgroupBarrier();
        rf[t] = bv;
        ru[t] = bi;
        for (var h = NT / 2u; h > 0u; h = h >> 1u) {
            workgroupBarrier();
            if (t < h && better(rf[t + h], ru[t + h], rf[t], ru[t])) {
                rf[t] = rf[t + h];
                ru[t] = ru[t + h];
            }
        }
        pv = workgroupUniformLoad(&rf[0]);
        pid = workgroupUniformLoad(&ru[0]);
        if (t == 0u) {
            ids[p.ids_off + row * p.top + k] = pid;
            vals[p.vals_off + row * p.top + k] = pv - l;
        }
    }
}
