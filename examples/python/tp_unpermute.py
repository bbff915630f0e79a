"""Tensor-parallel unpermute with PyTorch DTensor: moe_ep.torch.token_unpermute forward and
backward on hidden-dimension shards, checked against the same op in one process.

Run (CPU, gloo; the moe_ep package installed):

    torchrun --standalone --nproc-per-node 2 examples/python/tp_unpermute.py
    mpirun -n 2 python examples/python/tp_unpermute.py
    python examples/python/tp_unpermute.py --hidden 7      # one process: a 1-rank mesh

Under mpirun the rank and world size come from Open MPI's OMPI_COMM_WORLD_RANK /
OMPI_COMM_WORLD_SIZE (or MPICH's PMI_RANK / PMI_SIZE); the gloo rendezvous is at MASTER_ADDR
(default 127.0.0.1) and MASTER_PORT (default 29500: set it when another job uses that port).

What each rank does:
  1. builds the same tokens (N, H), indices (N, topK) and probs (N, topK) from one seed, and
     permutes them (moe_ep.torch.token_permute) into permuted_tokens (N*topK, H);
  2. places permuted_tokens Shard(1) (each rank holds a slice of the hidden dimension, the way a
     tensor-parallel expert layer leaves its output), probs and sorted_indices Replicate, on a
     1-D CPU mesh;
  3. runs out = token_unpermute(permuted_tokens, sorted_indices, probs) and out.backward(g) with
     g Shard(1).
DTensor picks the S strategy of SPEC §5 (docs/sharding.md) from the rule moe_ep registers: no
activation data moves. The expected placements: out Shard(1), the gradient of permuted_tokens
Shard(1), the gradient of probs Partial (each rank's dot products cover its columns only; the sum
over ranks is the value). The check: every rank runs the op in one process on the full tensors
and compares the full_tensor() of each result: out and grad permuted_tokens bit for bit,
grad_probs within the fp32 bound below. Rank 0 prints the placements and PASS; a mismatch prints
what differs, and every rank exits with status 1.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

import moe_ep.torch as mt


def init_from_launcher() -> None:
    """torchrun sets RANK / WORLD_SIZE / MASTER_*; mpirun sets its own variables; a plain
    `python` run is one rank."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        for rank_var, size_var in (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                                   ("PMI_RANK", "PMI_SIZE")):
            if rank_var in os.environ:
                os.environ["RANK"] = os.environ[rank_var]
                os.environ["WORLD_SIZE"] = os.environ[size_var]
                break
        else:
            os.environ["RANK"], os.environ["WORLD_SIZE"] = "0", "1"
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
    dist.init_process_group("gloo")


def grad_probs_bound(grad_out, permuted, sorted_indices, topk, world):
    """|DTensor - single process| bound for grad_probs[i, k] = dot(grad_out[i], permuted[S]).
    The single-process op sums the H fp32 products g_h * x_h in order; under DTensor each rank
    sums its columns' products and the Partial is then summed over the ranks. Both are fp32
    recursive sums of the same products, each within (terms - 1) * 2^-24 * sum|g_h x_h| of the
    exact value (at most H + world terms for the sharded one), so they differ by at most
    (H + world) * 2^-23 * sum|g_h x_h|."""
    rows = sorted_indices.long().view(-1, topk)
    absdot = (grad_out.double().abs().unsqueeze(1) * permuted.double().abs()[rows]).sum(-1)
    return (grad_out.shape[1] + world) * 2.0**-23 * absdot


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64, help="N")
    ap.add_argument("--hidden", type=int, default=1001, help="H (uneven shards: 501, 500 on 2)")
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.topk > args.experts:
        ap.error(f"--topk {args.topk} exceeds --experts {args.experts}")

    init_from_launcher()
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))

    # 1. The same data on every rank.
    g = torch.Generator().manual_seed(args.seed)
    n, h, k = args.tokens, args.hidden, args.topk
    tokens = torch.randn(n, h, generator=g)
    indices = torch.stack(
        [torch.randperm(args.experts, generator=g)[:k] for _ in range(n)]
    ).to(torch.int32)
    probs = torch.softmax(torch.randn(n, k, generator=g), dim=-1)
    grad_out = torch.randn(n, h, generator=g)
    permuted, sorted_indices = mt.token_permute(tokens, indices)

    # The single-process result.
    ref_permuted = permuted.clone().requires_grad_()
    ref_probs = probs.clone().requires_grad_()
    ref_out = mt.token_unpermute(ref_permuted, sorted_indices, ref_probs)
    ref_out.backward(grad_out)

    # 2-3. DTensor forward and backward.
    d_permuted = distribute_tensor(permuted, mesh, [Shard(1)]).requires_grad_()
    d_probs = distribute_tensor(probs, mesh, [Replicate()]).requires_grad_()
    d_sorted = distribute_tensor(sorted_indices, mesh, [Replicate()])
    d_out = mt.token_unpermute(d_permuted, d_sorted, d_probs)
    d_out.backward(distribute_tensor(grad_out, mesh, [Shard(1)]))

    # Placements as DTensor returned them, before any full_tensor() redistributes.
    results = {
        "out": (d_out, Shard(1), ref_out.detach()),
        "grad permuted_tokens": (d_permuted.grad, Shard(1), ref_permuted.grad),
        "grad_probs": (d_probs.grad, Partial(), ref_probs.grad),
    }
    errors = []
    for name, (d, want, _) in results.items():
        if d is None:
            errors.append(f"{name} is None")
        elif tuple(d.placements) != (want,):
            errors.append(f"{name}: placements {tuple(d.placements)}, expected ({want},)")
    if rank == 0:
        lo = d_permuted.to_local().shape[1]
        print(f"tp_unpermute: {world} ranks, N {n}, H {h} (rank 0 holds {lo} columns), "
              f"topK {k}", flush=True)
        for name, (d, _, _) in results.items():
            if d is not None:
                print(f"  {name} {', '.join(map(repr, d.placements))}", flush=True)

    for name, (d, _, ref) in results.items():
        if d is None:
            continue
        full = d.full_tensor()  # every rank takes part in each collective
        if name == "grad_probs":
            err = (full.double() - ref.double()).abs()
            bound = grad_probs_bound(grad_out, permuted, sorted_indices, k, world)
            if (err > bound).any():
                i = (err - bound).flatten().argmax().item()
                errors.append(f"grad_probs: |error| {err.flatten()[i].item():.3g} > bound "
                              f"{bound.flatten()[i].item():.3g} at flat index {i}")
        elif not torch.equal(full, ref):
            bad = (full != ref).nonzero()[0].tolist()
            errors.append(f"{name}: differs from the single-process op at {bad}: "
                          f"{full[tuple(bad)].item()!r} != {ref[tuple(bad)].item()!r}")

    for e in errors:
        print(f"rank {rank}: MISMATCH {e}", flush=True)
    failed = torch.tensor([1 if errors else 0])
    dist.all_reduce(failed)  # every rank exits alike
    if rank == 0 and failed.item() == 0:
        print("tp_unpermute: PASS", flush=True)
    dist.destroy_process_group()
    return 1 if failed.item() else 0


if __name__ == "__main__":
    code = main()
    # Leave without the interpreter's finalisation. A gloo worker thread that drops the last
    # reference to a tensor during finalisation must take the GIL, and CPython unwinds such a
    # thread (pthread_exit); the unwinding through C++ noexcept frames aborts the process
    # ("terminate called without an active exception", SIGABRT) after every result was printed.
    # CI saw it once at world 2 (PyTorch 2.13; pytorch/pytorch#179291 discusses the same crash).
    # The process group is destroyed and the output flushed by now, so nothing is lost.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
