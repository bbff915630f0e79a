"""The DTensor cases of test_dtensor.py, run on every rank of one gloo process group (CPU).

    python python/tests/dtensor_cases.py --store FILE --rank R --world-size N   (one process a rank)
    python -m torch.distributed.run --standalone --nproc-per-node N python/tests/dtensor_cases.py

Every rank builds the same full tensors (same seed), places them on a 1-D mesh, runs the op on
DTensors and compares, on every rank, the result's placements (read BEFORE full_tensor()) with
SPEC §5 and its full_tensor() with the single-process op on the full tensors. A failing case is
recorded and the next one runs (every rank runs the same collectives whatever the outcome, so
no rank waits for another); at the end rank 0 prints every rank's failures and a summary line
"dtensor_cases: world N: C cases, F failed", and every rank exits 1 if any case failed.

Which strategy DTensor picks (torch 2.13's propagation, given the two strategies of our rule):
- token-like inputs Shard(1) -> S, unless H < mesh size: DTensor drops a strategy whose input
  Shard(d) has fewer elements on d than ranks (torch.distributed.tensor._ops.utils.
  is_tensor_shardable), leaving R. H = 4 on 3 ranks (2, 2, 0) or H = 5 on 4 ranks (2, 2, 1, 0)
  runs S with an empty shard; H = 2 on 3 or 4 ranks runs R.
- Replicate -> R (both strategies cost 0; ties go to the first, R).
- Shard(0) -> R for the small tensors here: DTensor charges Shard(0) -> Shard(1) as an
  all-gather of one shard plus a 1 us penalty (it has no all-to-all cost model) and
  Shard(0) -> Replicate as an all-gather of the whole tensor, so S wins only once the extra
  bytes cost more than 1 us at the 19.3 GB/s it assumes between CPU ranks (pieces above about
  19.3 KB x n/(n-1)^2); the "large" case (128 x 256 fp32, 64 KB a rank on 2 ranks) checks that
  it then goes to S. (The C++ cost rule of docs/sharding.md counts bytes only and picks S for
  Shard(0) at any size.)
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

R, S = "R", "S"

# SPEC §5's table, written out from docs/spec.md (not from moe_ep): op -> strategy -> (inputs,
# outputs). "R" Replicate, "S1" Shard(1), "P" Partial, "-" absent. Inputs list the tensor
# arguments by their schema names; `probs` (and unpermute_grad_v2's permuted_tokens) are "-"
# when absent. Outputs are in the op's return order; grad_probs without probs is "-".
SPEC5 = {
    "token_permute": {
        R: ({"tokens": "R", "indices": "R"}, ["R", "R"]),
        S: ({"tokens": "S1", "indices": "R"}, ["S1", "R"]),
    },
    "token_permute_grad": {
        R: ({"tokens": "R", "grad_permuted_tokens": "R", "indices": "R", "sorted_indices": "R"},
            ["R"]),
        S: ({"tokens": "S1", "grad_permuted_tokens": "S1", "indices": "R",
             "sorted_indices": "R"}, ["S1"]),
    },
    "token_permute_grad_v2": {
        R: ({"grad_permuted_tokens": "R", "sorted_indices": "R"}, ["R"]),
        S: ({"grad_permuted_tokens": "S1", "sorted_indices": "R"}, ["S1"]),
    },
    "token_unpermute": {
        R: ({"permuted_tokens": "R", "sorted_indices": "R", "probs": "R"}, ["R"]),
        S: ({"permuted_tokens": "S1", "sorted_indices": "R", "probs": "R"}, ["S1"]),
    },
    "_token_unpermute": {
        R: ({"permuted_tokens": "R", "sorted_indices": "R", "probs": "R"}, ["R", "R"]),
        S: ({"permuted_tokens": "S1", "sorted_indices": "R", "probs": "R"}, ["S1", "S1"]),
    },
    "token_unpermute_grad": {
        R: ({"permuted_tokens": "R", "grad_out": "R", "sorted_indices": "R", "probs": "R"},
            ["R", "R"]),
        S: ({"permuted_tokens": "S1", "grad_out": "S1", "sorted_indices": "R", "probs": "R"},
            ["S1", "P"]),
    },
    "token_unpermute_grad_v2": {
        R: ({"grad_out": "R", "sorted_indices": "R", "probs": "R", "permuted_tokens": "R"},
            ["R", "R"]),
        S: ({"grad_out": "S1", "sorted_indices": "R", "probs": "R", "permuted_tokens": "S1"},
            ["S1", "P"]),
    },
}
OPS = list(SPEC5)
PROBS_OPS = ["token_unpermute", "_token_unpermute", "token_unpermute_grad",
             "token_unpermute_grad_v2"]
GRAD_PROBS_OPS = ["token_unpermute_grad", "token_unpermute_grad_v2"]


def spec5(op: str, strategy: str, has_probs: bool) -> Tuple[Dict[str, str], List[str]]:
    """SPEC §5's row with the "-" of absent probs applied."""
    inputs, outputs = SPEC5[op][strategy]
    inputs, outputs = dict(inputs), list(outputs)
    if not has_probs and op in PROBS_OPS:
        inputs["probs"] = "-"
        if op == "token_unpermute_grad_v2":
            inputs["permuted_tokens"] = "-"  # required only with probs
        if op in GRAD_PROBS_OPS:
            outputs[1] = "-"
    return inputs, outputs


# ------------------------------------------------------------------------------------------
# Cases


@dataclass(frozen=True)
class Shape:
    name: str
    n: int  # tokens N
    h: int  # hidden size H
    k: int  # topK; 0 means 1-D indices (topK 1)
    e: int  # experts
    num_out_tokens: Optional[int] = None
    dtype: torch.dtype = torch.float32  # tokens' and probs' dtype


SHAPES = [
    Shape("H10", n=6, h=10, k=2, e=4),  # uneven: 5,5 / 4,4,2 / 3,3,3,1
    Shape("H5-drop", n=7, h=5, k=0, e=3, num_out_tokens=-2),  # 1-D indices; 2,2,1,0 on 4 ranks
    Shape("H4-cap", n=5, h=4, k=2, e=3, num_out_tokens=7),  # 2,2,0 on 3 ranks; 3 rows dropped
    Shape("H2", n=5, h=2, k=2, e=3),  # H < mesh on 3 and 4 ranks: S is not eligible
    Shape("N0", n=0, h=10, k=2, e=4),  # no tokens
    Shape("H10-bf16", n=6, h=10, k=2, e=4, dtype=torch.bfloat16),
]
TOKEN_PLACEMENTS = ["S1", "S0", "R"]
# Index tensors and probs Shard(0) (redistributed to Replicate by DTensor) on two shapes, to keep
# the runtime down: uneven shards, and no rows (empty pieces everywhere).
INDEX_PLACEMENTS = ["R", "S0"]
INDEX_SHARD_SHAPES = ("H10", "N0")


@dataclass(frozen=True)
class Case:
    kind: str  # "op", "kwargs" (tensors passed by keyword), "autograd", "large"
    op: str
    shape: Shape
    tok: str = "S1"
    idx: str = "R"
    has_probs: bool = True

    @property
    def name(self) -> str:
        probs = "probs" if self.has_probs else "no-probs"
        return (f"{self.kind}:{self.op}[{self.shape.name}, tokens {self.tok}, "
                f"index {self.idx}, {probs}]")


KWARGS_OPS = ["token_permute", "token_unpermute", "_token_unpermute", "token_unpermute_grad",
              "token_unpermute_grad_v2"]
AUTOGRAD = ["permute", "unpermute", "_unpermute", "permute+unpermute"]


def build_cases() -> List[Case]:
    cases = []
    for shape in SHAPES:
        for op in OPS:
            for has_probs in ([True, False] if op in PROBS_OPS else [False]):
                for tok in TOKEN_PLACEMENTS:
                    for idx in INDEX_PLACEMENTS if shape.name in INDEX_SHARD_SHAPES else ["R"]:
                        cases.append(Case("op", op, shape, tok, idx, has_probs))
        if shape.name == "H10":
            for op in KWARGS_OPS:
                for tok in ("S1", "R"):
                    cases.append(Case("kwargs", op, shape, tok, "R", True))
        for op in AUTOGRAD:
            for has_probs in ([False] if op == "permute" else [True, False]):
                cases.append(Case("autograd", op, shape, "S1", "R", has_probs))
    cases.append(Case("large", "token_permute", Shape("128x256", 128, 256, 2, 8), "S0", "R"))
    return cases


def expected_strategy(case: Case, world: int) -> str:
    """See the module docstring."""
    if case.kind == "large":
        return S if world > 1 else R
    return S if case.tok == "S1" and case.shape.h >= world else R


# ------------------------------------------------------------------------------------------
# Running


class Mismatch(AssertionError):
    pass


def _shape_mismatch(what: str, got: torch.Tensor, want: torch.Tensor) -> str:
    return f"{what}: {got.dtype}{list(got.shape)}, expected {want.dtype}{list(want.shape)}"


def _describe(placements) -> str:
    return "(" + ", ".join(map(repr, placements)) + ")"


class Runner:
    def __init__(self, mesh, world: int, rank: int):
        from torch.distributed.tensor import Partial, Replicate, Shard

        self.mesh, self.world, self.rank = mesh, world, rank
        self.pl = {"R": Replicate(), "S0": Shard(0), "S1": Shard(1), "P": Partial()}

    # -- inputs -------------------------------------------------------------------------------
    def inputs(self, shape: Shape, seed: int):
        g = torch.Generator().manual_seed(seed)
        n, h = shape.n, shape.h
        topk = max(shape.k, 1)
        dt = shape.dtype
        tokens = torch.randn(n, h, generator=g).to(dt)
        if shape.k == 0:
            indices = torch.randint(0, shape.e, (n,), generator=g, dtype=torch.int32)
        else:
            indices = torch.randint(0, shape.e, (n, shape.k), generator=g, dtype=torch.int32)
        permuted, sorted_indices = torch.ops.moe_ep.token_permute(
            tokens, indices, shape.num_out_tokens
        )
        rows, m = permuted.shape[0], n * topk
        return dict(
            tokens=tokens,
            indices=indices,
            permuted=permuted,
            sorted_indices=sorted_indices,
            probs=torch.rand(n, topk, generator=g).to(dt),
            grad_permuted=torch.randn(rows, h, generator=g).to(dt),
            grad_out=torch.randn(n, h, generator=g).to(dt),  # unpermute's output rows with probs
            grad_out_no_probs=torch.randn(m, h, generator=g).to(dt),  # without (no reduction)
            topk=topk,
        )

    def dt(self, full: torch.Tensor, placement: str, requires_grad: bool = False):
        from torch.distributed.tensor import distribute_tensor

        # src_data_rank=None: every rank holds the same full tensor, so each cuts its own piece
        # (torch.chunk's split) without communication.
        x = distribute_tensor(full, self.mesh, [self.pl[placement]], src_data_rank=None)
        return x.requires_grad_(requires_grad)

    # -- checks -------------------------------------------------------------------------------
    def check_placement(self, what: str, x, want: str) -> None:
        if tuple(x.placements) != (self.pl[want],):
            raise Mismatch(
                f"{what}: placements {_describe(x.placements)}, expected ({self.pl[want]!r})"
            )

    def check_equal(self, what: str, got: torch.Tensor, want: torch.Tensor) -> None:
        if got.dtype != want.dtype or got.shape != want.shape:
            raise Mismatch(_shape_mismatch(what, got, want))
        if not torch.equal(got, want):
            bad = (got != want).nonzero()[0].tolist()
            raise Mismatch(
                f"{what}: not bitwise equal to the single-process op; first difference at {bad}: "
                f"{got[tuple(bad)].item()!r} != {want[tuple(bad)].item()!r}"
            )

    def check_grad_probs(self, what: str, got, want, grad_out, permuted, sorted_indices, topk):
        """grad_probs of the S strategy: DTensor sums the ranks' dot products over their columns
        (Partial), the single-process op sums over all H columns in order.

        fp32: both are fp32 recursive sums of the same fp32 products g_h * x_h, so each is within
        (terms - 1) * u * sum|g_h x_h| of the exact dot product (u = 2^-24; Higham, Accuracy and
        Stability of Numerical Algorithms, eq. 4.4), the sharded one with at most H + n terms in
        all (per-shard sums, then Gloo's n-term sum of the shards). Their difference is at most
        (H + n) * 2^-23 * sum|g_h x_h|.
        bf16/fp16 probs: on top of that the single-process value is rounded once to probs'
        dtype (unit roundoff u': error <= u' * sum|g_h x_h|), while under DTensor each shard's
        dot p_r is rounded to probs' dtype (errors summing to <= u' * sum_r |p_r| <=
        u' * sum|g_h x_h|) before Gloo adds the n pieces in that dtype (n - 1 roundings, each
        <= u' * sum|g_h x_h|): (n + 1) * u' * sum|g_h x_h| more. This is not "the last bit" of
        the result: when the shards' dots cancel, the error can exceed the result (docs/
        sharding.md, "Python: DTensor").
        Entries whose row was dropped are 0 in both, exactly."""
        if got.dtype != want.dtype or got.shape != want.shape:
            raise Mismatch(_shape_mismatch(what, got, want))
        h = grad_out.shape[1]
        rows = permuted.shape[0]
        flat = sorted_indices.long()
        kept = flat < rows
        absdot = torch.zeros(flat.shape[0], dtype=torch.float64)
        if kept.any():
            tok = torch.arange(flat.shape[0]) // topk
            absdot[kept] = (
                grad_out.double().abs()[tok[kept]] * permuted.double().abs()[flat[kept]]
            ).sum(1)
        bound = (h + self.world) * 2.0**-23 * absdot.view(want.shape)
        if want.dtype != torch.float32:
            u = torch.finfo(want.dtype).eps / 2
            bound = bound + (self.world + 1) * u * absdot.view(want.shape)
        err = (got.double() - want.double()).abs()
        dropped = ~kept.view(want.shape)
        if (err > bound).any() or not torch.equal(got[dropped], want[dropped]):
            i = (err - bound).flatten().argmax().item()
            raise Mismatch(
                f"{what}: |Partial sum - single-process| = {err.flatten()[i].item():.3g} exceeds "
                f"the bound {bound.flatten()[i].item():.3g} at flat index {i}"
            )

    # -- the op cases ---------------------------------------------------------------------------
    def run_op(self, case: Case, seed: int) -> None:
        ops = torch.ops.moe_ep
        x = self.inputs(case.shape, seed)
        tok, idx = case.tok, case.idx
        probs = x["probs"] if case.has_probs else None
        grad_out = x["grad_out"] if case.has_probs else x["grad_out_no_probs"]
        d = self.dt
        dprobs = d(probs, idx) if probs is not None else None
        op = case.op
        if op == "token_permute":
            ref = ops.token_permute(x["tokens"], x["indices"], case.shape.num_out_tokens)
            if case.kind == "kwargs":
                out = ops.token_permute(tokens=d(x["tokens"], tok), indices=d(x["indices"], idx),
                                        num_out_tokens=case.shape.num_out_tokens)
            else:
                out = ops.token_permute(d(x["tokens"], tok), d(x["indices"], idx),
                                        case.shape.num_out_tokens)
        elif op == "token_permute_grad":
            args = (x["tokens"], x["grad_permuted"], x["indices"], x["sorted_indices"])
            ref = ops.token_permute_grad(*args)
            out = ops.token_permute_grad(d(args[0], tok), d(args[1], tok), d(args[2], idx),
                                         d(args[3], idx))
        elif op == "token_permute_grad_v2":
            rest = (case.shape.n, case.shape.dtype, x["topk"])
            ref = ops.token_permute_grad_v2(x["grad_permuted"], x["sorted_indices"], *rest)
            out = ops.token_permute_grad_v2(d(x["grad_permuted"], tok),
                                            d(x["sorted_indices"], idx), *rest)
        elif op in ("token_unpermute", "_token_unpermute"):
            f = getattr(ops, op)
            ref = f(x["permuted"], x["sorted_indices"], probs)
            if case.kind == "kwargs":
                out = f(d(x["permuted"], tok), sorted_indices=d(x["sorted_indices"], idx),
                        restore_shape=[probs.shape[0], case.shape.h], probs=dprobs)
            else:
                out = f(d(x["permuted"], tok), d(x["sorted_indices"], idx), dprobs)
        elif op == "token_unpermute_grad":
            ref = ops.token_unpermute_grad(x["permuted"], grad_out, x["sorted_indices"], probs)
            if case.kind == "kwargs":
                out = ops.token_unpermute_grad(
                    grad_out=d(grad_out, tok), permuted_tokens=d(x["permuted"], tok),
                    probs=dprobs, sorted_indices=d(x["sorted_indices"], idx))
            else:
                out = ops.token_unpermute_grad(d(x["permuted"], tok), d(grad_out, tok),
                                               d(x["sorted_indices"], idx), dprobs)
        elif op == "token_unpermute_grad_v2":
            permuted = x["permuted"] if case.has_probs else None
            rows, dtype = x["permuted"].shape[0], case.shape.dtype
            ref = ops.token_unpermute_grad_v2(grad_out, x["sorted_indices"], rows, dtype, probs,
                                              False, None, permuted)
            dperm = d(permuted, tok) if permuted is not None else None
            if case.kind == "kwargs":
                out = ops.token_unpermute_grad_v2(
                    d(grad_out, tok), d(x["sorted_indices"], idx), rows, dtype, probs=dprobs,
                    restore_shape=list(grad_out.shape), permuted_tokens=dperm)
            else:
                out = ops.token_unpermute_grad_v2(d(grad_out, tok), d(x["sorted_indices"], idx),
                                                  rows, dtype, dprobs, False, None, dperm)
        else:
            raise AssertionError(op)
        ref = ref if isinstance(ref, tuple) else (ref,)
        out = out if isinstance(out, tuple) else (out,)
        strategy = expected_strategy(case, self.world)
        _, want_pl = spec5(op, strategy, case.has_probs)
        if len(out) != len(want_pl):
            raise Mismatch(f"{len(out)} outputs, SPEC §5 has {len(want_pl)}")
        # Placements first, all of them, before any full_tensor() (which would redistribute).
        for i, (o, w) in enumerate(zip(out, want_pl)):
            # "-" (grad_probs without probs) is the op's empty (0,) tensor, declared Replicate.
            self.check_placement(f"output {i} (strategy {strategy})", o, "R" if w == "-" else w)
        for i, (o, r, w) in enumerate(zip(out, ref, want_pl)):
            full = o.full_tensor()
            if w == "P":
                self.check_grad_probs(f"output {i} grad_probs", full, r, grad_out, x["permuted"],
                                      x["sorted_indices"], x["topk"])
            else:
                self.check_equal(f"output {i}", full, r)

    # -- autograd ------------------------------------------------------------------------------
    def run_autograd(self, case: Case, seed: int) -> None:
        x = self.inputs(case.shape, seed)
        strategy = expected_strategy(case, self.world)
        tok_pl = "S1" if strategy == S else "R"
        num_out = case.shape.num_out_tokens
        mt = torch.ops.moe_ep
        checks = []  # (name, DTensor, reference, expected placement, "eq" or "probs")

        def leaf(t, pl, grad=True):
            return t.clone().requires_grad_(grad), self.dt(t, pl, grad)

        probs, dprobs = leaf(x["probs"], "R") if case.has_probs else (None, None)
        grad_out = x["grad_out"] if case.has_probs else x["grad_out_no_probs"]
        if case.op == "permute":
            t, dt = leaf(x["tokens"], case.tok)
            p, _ = mt.token_permute(t, x["indices"], num_out)
            dp, _ = mt.token_permute(dt, self.dt(x["indices"], "R"), num_out)
            checks.append(("permuted_tokens", dp, p.detach(), tok_pl, "eq"))
            p.backward(x["grad_permuted"])
            dp.backward(self.dt(x["grad_permuted"], case.tok))
            checks.append(("tokens.grad", dt.grad, t.grad, tok_pl, "eq"))
        elif case.op in ("unpermute", "_unpermute"):
            pt, dpt = leaf(x["permuted"], case.tok)
            si, dsi = x["sorted_indices"], self.dt(x["sorted_indices"], "R")
            if case.op == "unpermute":
                o = mt.token_unpermute(pt, si, probs)
                do = mt.token_unpermute(dpt, dsi, dprobs)
            else:
                o = mt._token_unpermute(pt, si, probs)[0]
                do = mt._token_unpermute(dpt, dsi, dprobs)[0]
            checks.append(("out", do, o.detach(), tok_pl, "eq"))
            o.backward(grad_out)
            do.backward(self.dt(grad_out, case.tok))
            checks.append(("permuted_tokens.grad", dpt.grad, pt.grad, tok_pl, "eq"))
        elif case.op == "permute+unpermute":
            # The TP chain: Shard(1) tokens -> permute -> unpermute -> backward to the tokens.
            t, dt = leaf(x["tokens"], case.tok)
            p, si = mt.token_permute(t, x["indices"], num_out)
            dp, dsi = mt.token_permute(dt, self.dt(x["indices"], "R"), num_out)
            o = mt.token_unpermute(p, si, probs)
            do = mt.token_unpermute(dp, dsi, dprobs)
            checks.append(("out", do, o.detach(), tok_pl, "eq"))
            o.backward(grad_out)
            do.backward(self.dt(grad_out, case.tok))
            checks.append(("tokens.grad", dt.grad, t.grad, tok_pl, "eq"))
        else:
            raise AssertionError(case.op)
        if case.has_probs:
            checks.append(("probs.grad", dprobs.grad, probs.grad, "P" if strategy == S else "R",
                           "probs"))
        for name, d, _, want, _ in checks:
            if d is None:
                raise Mismatch(f"{name} is None")
            self.check_placement(f"{name} (strategy {strategy})", d, want)
        for name, d, ref, want, how in checks:
            full = d.full_tensor()
            if how == "probs" and want == "P":
                # x["permuted"] is also what permute gives in the chain case.
                self.check_grad_probs(name, full, ref, grad_out, x["permuted"],
                                      x["sorted_indices"], x["topk"])
            else:
                self.check_equal(name, full, ref)

    def run(self, case: Case, seed: int) -> None:
        if case.kind == "autograd":
            self.run_autograd(case, seed)
        else:
            self.run_op(case, seed)


def main(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", help="FileStore path (with --rank and --world-size)")
    ap.add_argument("--rank", type=int)
    ap.add_argument("--world-size", type=int)
    ap.add_argument("--timeout", type=float, default=60.0, help="collective timeout, seconds")
    args = ap.parse_args(argv)

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import moe_ep.torch  # noqa: F401  (registers the ops and their DTensor rules)

    timeout = datetime.timedelta(seconds=args.timeout)
    if args.store:
        store = dist.FileStore(args.store, args.world_size)
        dist.init_process_group("gloo", store=store, rank=args.rank,
                                world_size=args.world_size, timeout=timeout)
    else:
        dist.init_process_group("gloo", timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    start = time.monotonic()
    runner = Runner(mesh, world, rank)
    cases = build_cases()
    failures = []
    for i, case in enumerate(cases):
        try:
            runner.run(case, seed=1000 + i)
        except Mismatch as e:
            failures.append(f"{case.name}: {e}")
        except Exception as e:  # an op error: report it with where it came from
            tb = traceback.extract_tb(e.__traceback__)[-1]
            failures.append(f"{case.name}: {type(e).__name__}: {e} ({tb.filename}:{tb.lineno})")
    everyone: List[Optional[List[str]]] = [None] * world
    dist.all_gather_object(everyone, failures)
    failed = sorted({f.split(": ")[0] for fs in everyone for f in fs})
    if rank == 0:
        for r, fs in enumerate(everyone):
            for f in fs:
                print(f"FAIL rank {r}: {f}", flush=True)
        print(f"dtensor_cases: world {world}: {len(cases)} cases, {len(failed)} failed "
              f"({time.monotonic() - start:.1f} s)", flush=True)
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    # Leave without the interpreter's finalisation. A gloo worker thread that drops the last
    # reference to a tensor during finalisation must take the GIL, and CPython unwinds such a
    # thread (pthread_exit); the unwinding through C++ noexcept frames aborts the process
    # ("terminate called without an active exception", SIGABRT) after every result was printed.
    # CI saw it once at world 2 (PyTorch 2.13; pytorch/pytorch#179291 discusses the same crash).
    # The process group is destroyed and the output flushed by now, so nothing is lost.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
