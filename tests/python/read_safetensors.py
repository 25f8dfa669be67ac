#!/usr/bin/env python3
"""Reads a safetensors file with Python's standard library alone and checks its tensors.

The format: an 8-byte little-endian header length, a JSON header mapping each tensor's name to its
dtype, shape and byte range, then the raw data. Every tensor must be F32 with finite values, and the
names and shapes must be exactly those given.

usage: read_safetensors.py FILE NAME=SHAPE ...   (SHAPE as 32,64; a scalar as NAME=)
"""

import json
import math
import struct
import sys


def read(path):
    """The tensors of `path` as {name: (shape, values)}."""
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__", None)
    data = raw[8 + n :]
    tensors = {}
    for name, t in header.items():
        assert t["dtype"] == "F32", f"{path}: {name} is {t['dtype']}, expected F32"
        begin, end = t["data_offsets"]
        count = math.prod(t["shape"])
        assert end - begin == 4 * count and end <= len(data), f"{path}: {name} has bytes {begin}..{end} for {count} floats"
        tensors[name] = (tuple(t["shape"]), struct.unpack(f"<{count}f", data[begin:end]))
    return tensors


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    path, specs = sys.argv[1], sys.argv[2:]
    expected = {}
    for spec in specs:
        name, shape = spec.split("=")
        expected[name] = tuple(int(d) for d in shape.split(",") if d)
    tensors = read(path)
    got = {name: shape for name, (shape, _) in tensors.items()}
    assert got == expected, f"{path}: tensors {got}, expected {expected}"
    for name, (_, values) in tensors.items():
        assert all(math.isfinite(v) for v in values), f"{path}: {name} has non-finite values"
    print(f"{path}: " + ", ".join(f"{name} {list(shape)}" for name, shape in got.items()))


if __name__ == "__main__":
    main()
