//! Generates the bodies of the matmul kernels (`matmul_q.wgsl`,
//! `matmul_f.wgsl`) for one tile shape: straight-line WGSL with one named
//! variable per accumulator and per loaded word.
//!
//! lavapipe keeps local arrays in memory and runs every invocation as a SIMD
//! lane, so the register-blocked form (all tile indices resolved at
//! generation time) is several times faster there than loops over arrays, and
//! it is the natural form for GPUs too. Each accumulator `acc{r}_{c}` sums
//! the blocks of one (activation row, weight row) pair in order, so a row's
//! result never depends on the tile shape or on the other rows of the batch.

use std::fmt::Write;

/// Quantized weights (`wdt` 3: Q8_0, 4: Q4_0, 5: Q4_1) against Q8 activations.
/// `pair` (Q8_0 with word-aligned rows and an even block count): two blocks
/// (68 bytes, 17 aligned words) per step, so no word is loaded twice.
pub fn q_body(tm: usize, tn: usize, wdt: u32, bias: bool, pair: bool) -> String {
    if pair && wdt == 3 {
        return q8_pair_body(tm, tn, bias);
    }
    let mut s = String::new();
    for c in 0..tn {
        let _ = writeln!(
            s,
            "    let rb{c} = min(col0 + {c}u, p.n - 1u) * p.row_bytes;"
        );
    }
    for r in 0..tm {
        let _ = writeln!(s, "    let ar{r} = min(row0 + {r}u, p.m - 1u) * p.nb;");
        for c in 0..tn {
            let _ = writeln!(s, "    var acc{r}_{c} = 0.0;");
        }
    }
    s.push_str("    for (var b = 0u; b < p.nb; b = b + 1u) {\n");
    for r in 0..tm {
        let _ = writeln!(s, "        let ab{r} = ar{r} + b;");
        for j in 0..8 {
            let _ = writeln!(s, "        let a{r}_{j} = aq[ab{r} * 8u + {j}u];");
        }
        let _ = writeln!(s, "        let da{r} = am[ab{r} * 4u];");
        match wdt {
            4 => {
                let _ = writeln!(s, "        let ia{r} = i32(am[ab{r} * 4u + 2u]);");
            }
            5 => {
                let _ = writeln!(s, "        let sa{r} = am[ab{r} * 4u + 1u];");
            }
            _ => {}
        }
    }
    let block = match wdt {
        3 => 34,
        4 => 18,
        _ => 20,
    };
    let _ = writeln!(s, "        let ub = p.w_off + b * {block}u;");
    for c in 0..tn {
        match wdt {
            3 => {
                let _ = writeln!(
                    s,
                    "        let dw{c} = f16_bits_to_f32(ldw(rb{c}, ub) & 0xffffu);"
                );
                for j in 0..8 {
                    let _ = writeln!(s, "        let w{c}_{j} = ldw(rb{c}, ub + {}u);", 2 + 4 * j);
                }
            }
            _ => {
                let qs = if wdt == 4 { 2 } else { 4 };
                if wdt == 4 {
                    let _ = writeln!(
                        s,
                        "        let dw{c} = f16_bits_to_f32(ldw(rb{c}, ub) & 0xffffu);"
                    );
                } else {
                    let _ = writeln!(s, "        let dm{c} = ldw(rb{c}, ub);");
                    let _ = writeln!(s, "        let dw{c} = f16_bits_to_f32(dm{c} & 0xffffu);");
                    let _ = writeln!(s, "        let mw{c} = f16_bits_to_f32(dm{c} >> 16u);");
                }
                for j in 0..4 {
                    let _ = writeln!(
                        s,
                        "        let q{c}_{j} = ldw(rb{c}, ub + {}u);",
                        qs + 4 * j
                    );
                    let _ = writeln!(s, "        let w{c}_{j} = q{c}_{j} & 0x0f0f0f0fu;");
                    let _ = writeln!(
                        s,
                        "        let w{c}_{} = (q{c}_{j} >> 4u) & 0x0f0f0f0fu;",
                        j + 4
                    );
                }
            }
        }
    }
    for r in 0..tm {
        for c in 0..tn {
            let dots: Vec<String> = (0..8)
                .map(|j| format!("dot4I8Packed(w{c}_{j}, a{r}_{j})"))
                .collect();
            let _ = writeln!(s, "        let s{r}_{c} = {};", dots.join(" + "));
            let term = match wdt {
                3 => format!("f32(s{r}_{c}) * (dw{c} * da{r})"),
                4 => format!("f32(s{r}_{c} - 8 * ia{r}) * dw{c} * da{r}"),
                _ => format!("(dw{c} * da{r}) * f32(s{r}_{c}) + mw{c} * sa{r}"),
            };
            let _ = writeln!(s, "        acc{r}_{c} = acc{r}_{c} + {term};");
        }
    }
    s.push_str("    }\n");
    stores(&mut s, tm, tn, bias);
    s
}

fn q8_pair_body(tm: usize, tn: usize, bias: bool) -> String {
    let mut s = String::new();
    for c in 0..tn {
        let _ = writeln!(
            s,
            "    let rb{c} = (p.w_off + min(col0 + {c}u, p.n - 1u) * p.row_bytes) >> 2u;"
        );
    }
    for r in 0..tm {
        let _ = writeln!(s, "    let ar{r} = min(row0 + {r}u, p.m - 1u) * p.nb;");
        for c in 0..tn {
            let _ = writeln!(s, "    var acc{r}_{c} = 0.0;");
        }
    }
    s.push_str("    for (var b = 0u; b < p.nb; b = b + 2u) {\n");
    for r in 0..tm {
        for h in 0..2 {
            let _ = writeln!(s, "        let ab{r}_{h} = ar{r} + b + {h}u;");
            for j in 0..8 {
                let _ = writeln!(s, "        let a{r}_{h}_{j} = aq[ab{r}_{h} * 8u + {j}u];");
            }
            let _ = writeln!(s, "        let da{r}_{h} = am[ab{r}_{h} * 4u];");
        }
    }
    for c in 0..tn {
        let _ = writeln!(s, "        let i{c} = rb{c} + b * 17u / 2u;");
        for j in 0..17 {
            let _ = writeln!(s, "        let v{c}_{j} = w[i{c} + {j}u];");
        }
        let _ = writeln!(
            s,
            "        let dw{c}_0 = f16_bits_to_f32(v{c}_0 & 0xffffu);"
        );
        let _ = writeln!(s, "        let dw{c}_1 = f16_bits_to_f32(v{c}_8 >> 16u);");
        for j in 0..8 {
            let _ = writeln!(
                s,
                "        let w{c}_0_{j} = (v{c}_{j} >> 16u) | (v{c}_{} << 16u);",
                j + 1
            );
            let _ = writeln!(s, "        let w{c}_1_{j} = v{c}_{};", j + 9);
        }
    }
    for r in 0..tm {
        for c in 0..tn {
            for h in 0..2 {
                let dots: Vec<String> = (0..8)
                    .map(|j| format!("dot4I8Packed(w{c}_{h}_{j}, a{r}_{h}_{j})"))
                    .collect();
                let _ = writeln!(s, "        let s{r}_{c}_{h} = {};", dots.join(" + "));
                let _ = writeln!(
                    s,
                    "        acc{r}_{c} = acc{r}_{c} + f32(s{r}_{c}_{h}) * (dw{c}_{h} * da{r}_{h});"
                );
            }
        }
    }
    s.push_str("    }\n");
    stores(&mut s, tm, tn, bias);
    s
}

/// Float weights (`wdt` 0: f32, 1: f16, 2: bf16) against f32 activations.
/// `fast`: k % 4 == 0 and word-aligned weights (loads of 4 weights at once).
pub fn f_body(tm: usize, tn: usize, fast: bool, bias: bool) -> String {
    let mut s = String::new();
    for r in 0..tm {
        let _ = writeln!(
            s,
            "    let xr{r} = p.x_off + min(row0 + {r}u, p.m - 1u) * p.k;"
        );
    }
    for c in 0..tn {
        let _ = writeln!(s, "    let wr{c} = min(col0 + {c}u, p.n - 1u) * p.k;");
    }
    for r in 0..tm {
        for c in 0..tn {
            let _ = writeln!(s, "    var acc{r}_{c} = 0.0;");
        }
    }
    if fast {
        s.push_str("    for (var e = 0u; e < p.k; e = e + 4u) {\n");
        for r in 0..tm {
            let _ = writeln!(
                s,
                "        let x{r} = vec4<f32>(x[xr{r} + e], x[xr{r} + e + 1u], x[xr{r} + e + 2u], x[xr{r} + e + 3u]);"
            );
        }
        for c in 0..tn {
            let _ = writeln!(s, "        let w{c} = wel4(wr{c} + e);");
        }
        for r in 0..tm {
            for c in 0..tn {
                let _ = writeln!(s, "        acc{r}_{c} = acc{r}_{c} + dot(x{r}, w{c});");
            }
        }
    } else {
        s.push_str("    for (var e = 0u; e < p.k; e = e + 1u) {\n");
        for r in 0..tm {
            let _ = writeln!(s, "        let x{r} = x[xr{r} + e];");
        }
        for c in 0..tn {
            let _ = writeln!(s, "        let w{c} = wel(wr{c} + e);");
        }
        for r in 0..tm {
            for c in 0..tn {
                let _ = writeln!(s, "        acc{r}_{c} = acc{r}_{c} + x{r} * w{c};");
            }
        }
    }
    s.push_str("    }\n");
    stores(&mut s, tm, tn, bias);
    s
}

fn stores(s: &mut String, tm: usize, tn: usize, bias: bool) {
    for r in 0..tm {
        for c in 0..tn {
            let b = if bias {
                format!(" + bias[p.bias_off + col0 + {c}u]")
            } else {
                String::new()
            };
            let _ = writeln!(
                s,
                "    if (row0 + {r}u < p.m && col0 + {c}u < p.n) {{ \
                 out[p.out_off + (row0 + {r}u) * p.ldo + col0 + {c}u] = acc{r}_{c}{b}; }}"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_name_every_tile_variable() {
        let q = q_body(2, 3, 5, true, false);
        assert!(q_body(1, 2, 3, false, true).contains("v1_16"));
        assert!(
            q.contains("acc1_2") && q.contains("mw2") && q.contains("bias[p.bias_off + col0 + 2u]")
        );
        let f = f_body(4, 1, true, false);
        assert!(f.contains("acc3_0") && f.contains("wel4(wr0 + e)") && !f.contains("bias"));
    }
}
