#!/usr/bin/env python3
"""Checks an lbbsp mnist-mlp weights file from outside lbbsp.

Loads it with the `safetensors` package's numpy API, checks tensor names, dtypes and shapes
against mnist-mlp (784-512-256-10, PyTorch layout: weight [out, in], bias [out]), runs the
forward pass in numpy on the MNIST test set with the recipe's normalisation (x / 255, then one
mean and standard deviation over all features of the *training* set), and asserts that the
accuracy equals the one lbbsp reported.

usage: check_safetensors.py --weights model.safetensors --data DATA_DIR --expected-accuracy 0.9683
(DATA_DIR holds mnist/{train,t10k}-{images-idx3,labels-idx1}-ubyte.gz, as LBBSP_DATA does.)
"""

import argparse
import gzip
import os
import sys

import numpy as np
from safetensors.numpy import load_file

# Layer indices follow the recipe's `layers` list: 0 flatten, 1 linear, 2 relu, 3 linear, 4 relu, 5 linear.
EXPECTED = {
    "layers.1.weight": (512, 784),
    "layers.1.bias": (512,),
    "layers.3.weight": (256, 512),
    "layers.3.bias": (256,),
    "layers.5.weight": (10, 256),
    "layers.5.bias": (10,),
}


def read_idx(path):
    """An IDX file (gzip) as a numpy array: big-endian header, magic 0x0000080{1,3}, uint8 data."""
    with gzip.open(path, "rb") as f:
        raw = f.read()
    magic = int.from_bytes(raw[0:4], "big")
    if magic >> 8 != 0x08:
        sys.exit(f"{path}: not an unsigned-byte IDX file (magic {magic:#x})")
    ndim = magic & 0xFF
    dims = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if data.size != int(np.prod(dims)):
        sys.exit(f"{path}: {data.size} values, header says {dims}")
    return data.reshape(dims)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", required=True)
    ap.add_argument("--data", required=True, help="data folder (LBBSP_DATA)")
    ap.add_argument("--expected-accuracy", type=float, required=True, help="lbbsp's test_accuracy")
    args = ap.parse_args()

    tensors = load_file(args.weights)
    got = {k: tuple(v.shape) for k, v in tensors.items()}
    assert got == EXPECTED, f"names/shapes {got}, expected {EXPECTED}"
    for k, v in tensors.items():
        assert v.dtype == np.float32, f"{k} is {v.dtype}, expected float32"
        assert np.all(np.isfinite(v)), f"{k} has non-finite values"

    mnist = os.path.join(args.data, "mnist")
    train_x = read_idx(os.path.join(mnist, "train-images-idx3-ubyte.gz"))
    test_x = read_idx(os.path.join(mnist, "t10k-images-idx3-ubyte.gz"))
    test_y = read_idx(os.path.join(mnist, "t10k-labels-idx1-ubyte.gz"))
    assert train_x.shape == (60000, 28, 28) and test_x.shape == (10000, 28, 28), (train_x.shape, test_x.shape)

    # The recipe's normalisation, as lbbsp's Normalizer does it: statistics in f64 over every
    # feature of the training set after dividing by the scale, applied in f32 as
    # (raw · (1/255) − mean) · (1/std).
    scaled = train_x.astype(np.float64) / 255.0
    mean = scaled.mean()
    std = np.sqrt(max((scaled * scaled).mean() - mean * mean, 0.0))
    x = test_x.reshape(len(test_x), -1).astype(np.float32)
    x = (x * np.float32(1.0 / 255.0) - np.float32(mean)) * np.float32(1.0 / std)

    h = np.maximum(x @ tensors["layers.1.weight"].T + tensors["layers.1.bias"], 0)
    h = np.maximum(h @ tensors["layers.3.weight"].T + tensors["layers.3.bias"], 0)
    logits = h @ tensors["layers.5.weight"].T + tensors["layers.5.bias"]
    pred = logits.argmax(axis=1)
    correct = int((pred == test_y).sum())
    n = len(test_y)
    expected = round(args.expected_accuracy * n)
    top2 = np.sort(logits, axis=1)[:, -2:]
    near_ties = int((top2[:, 1] - top2[:, 0] < 1e-4).sum())
    print(f"numpy forward pass: {correct}/{n} correct ({100.0 * correct / n:.2f}%), lbbsp reported {expected}/{n}; "
          f"{near_ties} prediction(s) within 1e-4 of a tie")
    assert correct == expected, f"accuracy {correct}/{n} differs from lbbsp's {expected}/{n}"


if __name__ == "__main__":
    main()
