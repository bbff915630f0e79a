#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz targets (tests/fuzz/corpus/<target>/seed-*).

safetensors: small routing files as `moe-ep run --save-routing` writes them (with and without
tokens_per_rank, x_active_mask and metadata, each dtype of x) and a few malformed ones (deep
nesting, bad offsets, overlapping tensors, a short file). local_ops and dispatch read their input
as a stream of decisions (tests/fuzz/fuzz_common.h, Input): the seeds are one short stream per op
or path with small sizes, so the fuzzer starts from calls that pass validation and run.
Usage: tests/fuzz/make_seeds.py [corpus dir] (default: tests/fuzz/corpus beside this script).
"""
import json
import os
import struct
import sys


def safetensors(tensors, metadata=None, header_text=None):
    """tensors: [(name, dtype, shape, raw bytes)] -> the file's bytes."""
    header, data, offset = {}, b"", 0
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        data += raw
        offset += len(raw)
    if metadata:
        header["__metadata__"] = metadata
    text = header_text if header_text is not None else json.dumps(header, separators=(",", ":"))
    text += " " * ((8 - len(text) % 8) % 8)
    return struct.pack("<Q", len(text)) + text.encode() + data


def routing(n, k, h, x_dtype="F32", tokens_per_rank=None, mask=None, metadata=None):
    esize = {"F32": 4, "BF16": 2, "F16": 2}[x_dtype]
    ids = struct.pack(f"<{n * k}i", *[(i * k + j) % 4 for i in range(n) for j in range(k)])
    scales = struct.pack(f"<{n * k}f", *[0.5] * (n * k))
    one = {"F32": b"\x00\x00\x80\x3f", "BF16": b"\x80\x3f", "F16": b"\x00\x3c"}[x_dtype]
    x = one * (n * h)
    assert len(x) == n * h * esize
    t = [("expert_ids", "I32", [n, k], ids), ("expert_scales", "F32", [n, k], scales),
         ("x", x_dtype, [n, h], x)]
    if tokens_per_rank is not None:
        t.append(("tokens_per_rank", "I64", [len(tokens_per_rank)],
                  struct.pack(f"<{len(tokens_per_rank)}q", *tokens_per_rank)))
    if mask is not None:
        shape, values = mask
        t.append(("x_active_mask", "BOOL", shape, bytes(values)))
    return safetensors(t, metadata)


def safetensors_seeds():
    meta = {"moe_expert_num": "4", "zero_expert_num": "0", "copy_expert_num": "0",
            "const_expert_num": "0", "seed": "7", "preset": "olmoe", "routing": "uniform"}
    yield "routing_f32", routing(3, 2, 4, metadata=meta)
    yield "routing_bf16_split", routing(4, 2, 2, "BF16", tokens_per_rank=[1, 3])
    yield "routing_f16_mask1d", routing(4, 1, 2, "F16", mask=([4], [1, 1, 1, 0]))
    yield "routing_mask2d", routing(2, 2, 2, mask=([2, 2], [1, 0, 1, 1]), metadata={"seed": "x"})
    yield "routing_empty", routing(0, 2, 4)
    yield "deep_nesting", safetensors([], header_text="[" * 100 + "]" * 100)
    yield "overlap", safetensors([], header_text=json.dumps(
        {"a": {"dtype": "I32", "shape": [1], "data_offsets": [0, 4]},
         "b": {"dtype": "I32", "shape": [1], "data_offsets": [2, 6]}})) + bytes(8)
    yield "huge_shape", safetensors([], header_text=json.dumps(
        {"a": {"dtype": "F32", "shape": [4611686018427387904, 4], "data_offsets": [0, 0]}}))
    yield "short", b"\x10\x00\x00"


def stream(*values):
    return bytes(v & 0xFF for v in values)


def local_ops_seeds():
    # op, padded, N, H, K, dtype, then per tensor: dtype, ndim, dims, strides, contents.
    for op in range(7):
        for padded in (0, 200):
            yield f"op{op}_padded{padded}", stream(op, padded, 3, 4, 2, op % 3) + bytes(
                (i * 37 + op) % 256 for i in range(200))


def dispatch_seeds():
    # config bytes (mostly the usual values: < 160), sizes, path selector, inputs.
    for path in (0, 150, 210, 250):
        for tail in (0, 1):
            yield f"path{path}_{tail}", bytes([0] * 20) + stream(2, 3, 1, 1, path) + bytes(
                (i * 11 + tail * 5) % 256 for i in range(160))


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "corpus")
    for target, seeds in (("safetensors", safetensors_seeds), ("local_ops", local_ops_seeds),
                          ("dispatch", dispatch_seeds)):
        os.makedirs(os.path.join(root, target), exist_ok=True)
        for name, data in seeds():
            with open(os.path.join(root, target, "seed-" + name), "wb") as f:
                f.write(data)


if __name__ == "__main__":
    main()
