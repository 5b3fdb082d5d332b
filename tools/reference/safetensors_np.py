"""Safetensors files as numpy arrays, bf16 included (numpy's safetensors binding reads no bf16),
for the fixture scripts that need only numpy and ml_dtypes. Tensors are written in name order
with an 8-byte-aligned header, so a rerun writes the same bytes."""

import json
from pathlib import Path

import ml_dtypes
import numpy as np

DTYPES = {"BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32, "I32": np.int32,
          "U8": np.uint8, "I64": np.int64, "F8_E4M3": ml_dtypes.float8_e4m3fn}


def load_file(path: Path) -> dict:
    """A safetensors file's tensors, by name."""
    raw = path.read_bytes()
    size = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + size])
    data = raw[8 + size :]
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        a, b = t["data_offsets"]
        out[name] = np.frombuffer(data[a:b], DTYPES[t["dtype"]]).reshape(t["shape"]).copy()
    return out


def save_file(tensors: dict, path: Path) -> None:
    """Writes `tensors` (name -> array) as a safetensors file."""
    names = {v: k for k, v in DTYPES.items()}
    header, chunks, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        blob = a.tobytes()
        header[name] = {"dtype": names[a.dtype.type], "shape": list(a.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        chunks.append(blob)
        offset += len(blob)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    path.write_bytes(len(head).to_bytes(8, "little") + head + b"".join(chunks))
