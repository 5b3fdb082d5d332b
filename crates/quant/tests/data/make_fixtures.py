"""Writes the fixtures of tests/ggml_fixtures.rs with gguf-py (an independent
numpy port of ggml's quantizers and dequantizers).

Run: /work/pyenv/bin/python crates/quant/tests/data/make_fixtures.py [model.gguf]

For each format NAME:
  NAME.bin  quantized bytes (legacy formats: gguf-py's quantize of NAME.src;
            K formats: random bytes with sane f16 scales)
  NAME.f32  gguf-py's dequantization of NAME.bin (little-endian f32)
  NAME.src  (legacy formats only) the f32 input that was quantized
With a model path, also writes model_<tensor>.bin/.f32 from 4 rows of real tensors.
"""
import os
import sys

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants

HERE = os.path.dirname(os.path.abspath(__file__))
rng = np.random.default_rng(1234)


def write(name, arr):
    with open(os.path.join(HERE, name), "wb") as f:
        f.write(np.ascontiguousarray(arr).tobytes())


LEGACY = {"q4_0": T.Q4_0, "q4_1": T.Q4_1, "q5_0": T.Q5_0, "q5_1": T.Q5_1, "q8_0": T.Q8_0}
for name, t in LEGACY.items():
    x = rng.standard_normal((4, 256)).astype(np.float32)
    x[1] *= 0.01
    x[2, :32] = 0.0  # an all-zero block
    x[3] += 0.5
    q = quants.quantize(x, t)
    write(name + ".src", x)
    write(name + ".bin", q)
    write(name + ".f32", quants.dequantize(q, t).astype(np.float32))

K = {"q2_k": (T.Q2_K, 84, [80, 82]), "q3_k": (T.Q3_K, 110, [108]), "q4_k": (T.Q4_K, 144, [0, 2]),
     "q5_k": (T.Q5_K, 176, [0, 2]), "q6_k": (T.Q6_K, 210, [208])}
for name, (t, bb, offs) in K.items():
    nb = 6
    raw = rng.integers(0, 256, size=(nb, bb), dtype=np.uint8)
    for o in offs:
        d = (rng.random(nb) * 0.01 + 1e-4).astype(np.float16).view(np.uint8).reshape(nb, 2)
        raw[:, o:o + 2] = d
    q = raw.reshape(1, nb * bb)
    write(name + ".bin", q)
    write(name + ".f32", quants.dequantize(q, t).astype(np.float32))

if len(sys.argv) > 1:
    from gguf import GGUFReader

    r = GGUFReader(sys.argv[1])
    for t in r.tensors:
        if t.name in ("blk.0.attn_q.weight", "token_embd.weight"):
            data = np.asarray(t.data)[:4]
            tag = t.name.split(".")[0] if t.name.startswith("token") else "attn_q"
            write("model_%s_%s.bin" % (tag, t.tensor_type.name.lower()), data)
            write("model_%s_%s.f32" % (tag, t.tensor_type.name.lower()),
                  quants.dequantize(data, t.tensor_type).astype(np.float32))
