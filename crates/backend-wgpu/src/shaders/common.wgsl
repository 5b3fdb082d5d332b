// Helpers shared by every kernel (prepended to each shader's source).

const WG: u32 = 64u;

// Flat index of this invocation in a 2-D grid of 64-wide workgroups.
fn flat_index(wid: vec3<u32>, nwg: vec3<u32>, lid: vec3<u32>) -> u32 {
    return (wid.y * nwg.x + wid.x) * WG + lid.x;
}

fn f16_bits_to_f32(bits: u32) -> f32 {
    return unpack2x16float(bits & 0xffffu).x;
}

fn bf16_bits_to_f32(bits: u32) -> f32 {
    return bitcast<f32>(bits << 16u);
}

// f32 -> f16 bits, rounding to nearest even (as the `half` crate), independent of
// the driver's own conversion.
fn f32_to_f16_bits(v: f32) -> u32 {
    let x = bitcast<u32>(v);
    let sign = (x >> 16u) & 0x8000u;
    let exp = (x >> 23u) & 0xffu;
    let man = x & 0x7fffffu;
    if (exp == 0xffu) {
        if (man != 0u) {
            return sign | 0x7e00u | (man >> 13u);
        }
        return sign | 0x7c00u;
    }
    let e = i32(exp) - 112;
    if (e >= 31) {
        return sign | 0x7c00u;
    }
    if (e <= 0) {
        if (e < -10) {
            return sign;
        }
        let m = man | 0x800000u;
        let shift = u32(14 - e);
        var r = m >> shift;
        let rem = m & ((1u << shift) - 1u);
        let halfway = 1u << (shift - 1u);
        if (rem > halfway || (rem == halfway && (r & 1u) == 1u)) {
            r = r + 1u;
        }
        return sign | r;
    }
    var h = (u32(e) << 10u) | (man >> 13u);
    let rem = man & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u) == 1u)) {
        h = h + 1u;
    }
    return sign | h;
}

// f32 -> bf16 bits, rounding to nearest even (as the `half` crate).
fn f32_to_bf16_bits(v: f32) -> u32 {
    let x = bitcast<u32>(v);
    if ((x & 0x7fffffffu) > 0x7f800000u) {
        return (x >> 16u) | 0x40u;
    }
    let round = 0x7fffu + ((x >> 16u) & 1u);
    return (x + round) >> 16u;
}

// Rounds an f32 to the nearest f16 value (as an f32).
fn round_f16(v: f32) -> f32 {
    return f16_bits_to_f32(f32_to_f16_bits(v));
}

// Sign-extends the low byte of `b`.
fn sext8(b: u32) -> i32 {
    return bitcast<i32>(b << 24u) >> 24u;
}
