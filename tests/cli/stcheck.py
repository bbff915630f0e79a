#!/usr/bin/env python3
"""Independent checks of `moe-ep run` files, standard library only (no numpy, nothing from tools/).

  stcheck.py check-scale ROUTING OUTPUT --experts E
      Recomputes SPEC §2.3 for --expert-fn scale from the saved routing (x, expert_ids,
      expert_scales) and compares the saved output bit for bit:
        y_ik = round_dtype(f32(fp32(x_i) * f32(1 + f32(e / E))))
        acc = 0; for k: acc = f32(acc + f32(scale_ik * y_ik)); out_i = round_dtype(acc)
      fp32 arithmetic is emulated with doubles rounded through array('f') (exact: a product or sum of
      two floats is rounded once from a double holding it to within double rounding's innocuous
      bound).
  stcheck.py corrupt IN OUT --mode repeat|range|nan|inf|seed|experts --experts E
      Copies a routing file, making token 0 repeat its first expert (repeat), giving the last
      token's last slot the id E + 3 (range), setting expert_scales[3,0] to NaN (nan) or x[5,17]
      to +inf (inf), the metadata seed to 'xyz' (seed), or moe_expert_num to 'abc' (experts).
"""
import argparse
import json
import struct
import sys
from array import array

SIZES = {"BF16": 2, "F16": 2, "F32": 4, "I32": 4, "I64": 8}


def read(path):
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack_from("<Q", blob, 0)
    header = json.loads(blob[8:8 + n].decode("utf-8"))
    meta = header.pop("__metadata__", {})
    base = 8 + n
    tensors = {}
    for name, t in header.items():
        begin, end = t["data_offsets"]
        count = 1
        for d in t["shape"]:
            count *= d
        assert end - begin == count * SIZES[t["dtype"]], name
        tensors[name] = (t["dtype"], t["shape"], blob[base + begin:base + end])
    return tensors, meta


def write(path, tensors, meta):
    header, offset, chunks = {}, 0, []
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        chunks.append(data)
    if meta:
        header["__metadata__"] = meta
    text = json.dumps(header).encode("utf-8")
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(chunks))


def f32(values):
    """Rounds doubles to float32 (nearest even), elementwise."""
    return array("f", values).tolist()


def decode(dtype, data):
    n = len(data) // SIZES[dtype]
    if dtype == "F32":
        return list(struct.unpack("<%df" % n, data))
    if dtype == "F16":
        return list(struct.unpack("<%de" % n, data))
    bits = struct.unpack("<%dH" % n, data)  # BF16: the top half of a float32
    return list(struct.unpack("<%df" % n, struct.pack("<%dI" % n, *[b << 16 for b in bits])))


def encode(dtype, values):
    """float32 values -> dtype bytes, rounded to nearest even."""
    n = len(values)
    if dtype == "F32":
        return struct.pack("<%df" % n, *values)
    if dtype == "F16":
        return struct.pack("<%de" % n, *values)
    out = []
    for u in struct.unpack("<%dI" % n, struct.pack("<%df" % n, *values)):
        if (u & 0x7FFFFFFF) > 0x7F800000:
            out.append((u >> 16) | 0x40)
        else:
            out.append(((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF)
    return struct.pack("<%dH" % n, *out)


def check_scale(args):
    t, _ = read(args.routing)
    o, _ = read(args.output)
    xdt, (N, H), xdata = t["x"]
    _, (n2, K), ids_data = t["expert_ids"]
    ids = struct.unpack("<%di" % (N * K), ids_data)
    scales = struct.unpack("<%df" % (N * K), t["expert_scales"][2])
    odt, oshape, odata = o["output"]
    if odt != xdt or oshape != [N, H] or n2 != N:
        sys.exit("FAIL: output is %s %s, routing x is %s [%d, %d]" % (odt, oshape, xdt, N, H))
    E = args.experts
    x = decode(xdt, xdata)
    mismatches = 0
    for i in range(N):
        row = x[i * H:(i + 1) * H]
        acc = [0.0] * H
        for k in range(K):
            e = ids[i * K + k]
            if e < 0:
                continue
            factor = f32([1.0 + f32([e / E])[0]])[0]
            y = decode(xdt, encode(xdt, f32([v * factor for v in row])))
            s = scales[i * K + k]
            p = f32([s * v for v in y])
            acc = f32([a + b for a, b in zip(acc, p)])
        want = encode(xdt, acc)
        got = odata[i * len(want):(i + 1) * len(want)]
        if got != want:
            mismatches += 1
            if mismatches <= 3:
                print("token %d differs" % i)
    if mismatches:
        sys.exit("FAIL: %d of %d tokens differ from SPEC 2.3" % (mismatches, N))
    print("OK: %d tokens x %d (%s, K %d, E %d) match SPEC 2.3 bit for bit" % (N, H, xdt, K, E))


def corrupt(args):
    t, meta = read(args.input)
    dtype, (N, K), data = t["expert_ids"]
    ids = list(struct.unpack("<%di" % (N * K), data))
    if args.mode == "repeat":
        ids[1] = ids[0]
    elif args.mode == "range":
        ids[N * K - 1] = args.experts + 3
    elif args.mode == "nan":
        sdt, shape, sdata = t["expert_scales"]
        scales = list(struct.unpack("<%df" % (N * K), sdata))
        scales[3 * K] = float("nan")
        t["expert_scales"] = (sdt, shape, struct.pack("<%df" % (N * K), *scales))
    elif args.mode == "inf":
        xdt, (n, H), xdata = t["x"]
        x = decode(xdt, xdata)
        x[5 * H + 17] = float("inf")
        t["x"] = (xdt, [n, H], encode(xdt, x))
    elif args.mode == "seed":
        meta["seed"] = "xyz"
    else:
        meta["moe_expert_num"] = "abc"
    t["expert_ids"] = (dtype, [N, K], struct.pack("<%di" % (N * K), *ids))
    write(args.output, t, meta)


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check-scale")
    c.add_argument("routing")
    c.add_argument("output")
    c.add_argument("--experts", type=int, required=True)
    c.set_defaults(fn=check_scale)
    b = sub.add_parser("corrupt")
    b.add_argument("input")
    b.add_argument("output")
    b.add_argument("--mode", choices=["repeat", "range", "nan", "inf", "seed", "experts"], required=True)
    b.add_argument("--experts", type=int, required=True)
    b.set_defaults(fn=corrupt)
    args = p.parse_args()
    args.fn(args)


if __name__ == "__main__":
    main()
