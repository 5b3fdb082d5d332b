#!/usr/bin/env python3
"""Fails if a release binary calls a SIMD intrinsic out of line from Arbor's code.

A Rust closure inside a SIMD kernel is compiled without its caller's target
features, so the intrinsics in it become calls to `core::core_arch::x86::*`
functions unless the optimizer happens to inline the closure; one such
build ran the 16-row GEMM 2.7x and batch-1 decode 4x slower. This reads the
disassembly (`objdump -d -C`) and reports every function of an Arbor crate
that calls a `core_arch` x86 intrinsic, directly or through one non-Arbor
function (e.g. `core::array::from_fn`). Usage: check-kernel-inlining.py BINARY
"""
import re
import subprocess
import sys


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__)
        return 2
    dis = subprocess.run(
        ["objdump", "-d", "-C", "--no-show-raw-insn", sys.argv[1]],
        check=True, capture_output=True, text=True,
    ).stdout
    calls: dict[str, set[str]] = {}
    func = None
    head = re.compile(r"^[0-9a-f]+ <(.*)>:$")
    call = re.compile(r"\scall\s+[0-9a-f]+ <(.*?)(\+0x[0-9a-f]+)?>")
    for line in dis.splitlines():
        m = head.match(line)
        if m:
            func = m.group(1)
            continue
        m = call.search(line)
        if m and func:
            calls.setdefault(func, set()).add(m.group(1))
    is_intrinsic = lambda f: f.startswith("core::core_arch::x86::")
    is_arbor = lambda f: "arbor_" in f.split("::")[0] or f.startswith("<arbor_")
    # Non-Arbor helpers that call an intrinsic (one level of indirection).
    helpers = {f for f, cs in calls.items() if not is_arbor(f) and any(map(is_intrinsic, cs))}
    bad = []
    for f, cs in sorted(calls.items()):
        if not is_arbor(f):
            continue
        for c in sorted(cs):
            if is_intrinsic(c) or c in helpers:
                bad.append(f"{f} -> {c}")
    if bad:
        print("out-of-line SIMD intrinsics called from Arbor code:")
        print("\n".join(f"  {b}" for b in bad))
        return 1
    print(f"{sys.argv[1]}: no out-of-line SIMD intrinsic in Arbor code")
    return 0


if __name__ == "__main__":
    sys.exit(main())
