"""A Mixtral-style mixture-of-experts layer with expert parallelism: moe_ep.torch.dispatch_v2 /
combine_v2 over MPI, checked against the same layer computed densely in one process.

Run (any world size W that divides --experts; mpi4py and the moe_ep package installed):

    mpirun -n 4 --oversubscribe python examples/python/moe_layer.py
    mpirun -n 2 python examples/python/moe_layer.py --dtype bf16 --tokens 33 --top-k 3
    python examples/python/moe_layer.py            # W = 1: all experts on one rank

What each rank does:
  1. router: logits = x @ gate^T in fp32, softmax, top-k, weights renormalised to sum to 1
     (Mixtral's routing);
  2. dispatch_v2 sends each (token, expert) copy to the rank that hosts the expert: E experts
     split over W ranks, rank r hosts experts [r*L, (r+1)*L), L = E / W;
  3. the L local experts (SwiGLU MLPs: w2(silu(w1 x) * w3 x)) run on the received rows, which
     arrive grouped by local expert (expert_token_nums rows each; only the first
     sum(expert_token_nums) rows of expand_x are valid);
  4. combine_v2 brings the outputs back and sums them weighted by the routing weights.

The check: every rank rebuilds every expert from its seed, gathers all ranks' tokens and
computes the whole layer in a plain loop over tokens and their experts (one token at a time),
then compares its own slice. Rank 0 prints PASS; a mismatch prints the worst element on the
failing rank and exits with status 1.

Tolerances. The two computations do the same arithmetic except that the EP path runs each expert
on a batch of rows and the reference on one row, so the matrix products may round differently
(different blocking); combine_v2 sums in fp32 in top-k order, as the reference does.
  fp32 (default): each output is a sum of products of length <= ffn; a reordering of such a sum
    moves it by at most ~n * 2^-24 of the sum of the magnitudes of its terms. The check uses
    |ep - ref| <= 2^-14 * (1 + |ref|), a wide margin over that for the default sizes, and tight
    enough that any misrouted row (an O(1) change) fails it.
  bf16: every linear layer's output is rounded to bf16 (unit roundoff 2^-9) and may round the
    other way in the two paths, i.e. differ by one bf16 ulp (2^-8 relative); such a difference
    in the hidden activation passes through w2 scaled by O(1) weights, and the final rounding of
    combine adds another half ulp. The check uses |ep - ref| <= 2^-5 * (1 + max|ref row|) per
    row: a few bf16 ulps, far below the O(1) change of a misrouted row.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

import moe_ep.torch as moe_torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class SwiGLUExpert(nn.Module):
    """Mixtral's expert MLP: w2(silu(w1 x) * w3 x), no biases."""

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn, bias=False)
        self.w3 = nn.Linear(hidden, ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def make_expert(e: int, args, dtype: torch.dtype) -> SwiGLUExpert:
    """Expert e, identical on every rank that builds it: its weights come from seed + 1000 + e."""
    torch.manual_seed(args.seed + 1000 + e)
    return SwiGLUExpert(args.hidden, args.ffn).to(dtype)


def make_router(args) -> nn.Linear:
    """The gate (E, H), fp32 on every rank: fp32 logits make top-k ties (which a bf16 router
    would produce often) practically impossible."""
    torch.manual_seed(args.seed)
    return nn.Linear(args.hidden, args.experts, bias=False)


def make_tokens(rank: int, args, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(args.seed * 7919 + 17 + rank)
    return torch.randn(args.tokens, args.hidden, generator=g).to(dtype)


def route(router: nn.Linear, x: torch.Tensor, k: int):
    """Mixtral's routing: softmax over all experts in fp32, top-k, renormalised. Returns
    (expert_ids (BS, K) int32, weights (BS, K) fp32)."""
    probs = F.softmax(router(x.float()), dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids.to(torch.int32), weights


def moe_forward_ep(x, router, local_experts, args, comm) -> torch.Tensor:
    """The layer with expert parallelism over comm."""
    expert_ids, weights = route(router, x, args.top_k)
    expand_x, _, assist_info, expert_token_nums, ep_recv_counts, _, _ = moe_torch.dispatch_v2(
        x, expert_ids, comm, moe_expert_num=args.experts
    )
    # expert_token_nums (type 1, the default): rows per local expert, in local-expert order.
    # Rows past their sum are padding (expand_x has room for the most this rank could receive).
    expert_out = torch.zeros_like(expand_x)
    start = 0
    for expert, n in zip(local_experts, expert_token_nums.tolist()):
        if n:
            expert_out[start : start + n] = expert(expand_x[start : start + n])
        start += n
    return moe_torch.combine_v2(
        expert_out, expert_ids, assist_info, ep_recv_counts, weights, comm,
        moe_expert_num=args.experts,
    )


def moe_forward_dense(x, router, experts, args) -> torch.Tensor:
    """The same layer without parallelism: a plain loop over tokens and their top-k experts,
    summing weight * expert(token) in fp32 in top-k order, rounded once to x's dtype."""
    expert_ids, weights = route(router, x, args.top_k)
    out = torch.empty_like(x)
    for i in range(x.shape[0]):
        acc = torch.zeros(args.hidden, dtype=torch.float32)
        for k in range(args.top_k):
            y = experts[int(expert_ids[i, k])](x[i : i + 1])[0]
            acc += weights[i, k] * y.float()
        out[i] = acc.to(x.dtype)
    return out


# Inference: no gradients here. dispatch_v2 / combine_v2 are differentiable (SPEC §6, with
# combine_v2 given handle=); examples/python/train_moe.py trains a MoE block through them.
@torch.no_grad()
def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=int, default=8, help="E, a multiple of the world size")
    p.add_argument("--top-k", type=int, default=2, help="K <= E")
    p.add_argument("--hidden", type=int, default=64, help="H")
    p.add_argument("--ffn", type=int, default=128, help="expert intermediate size")
    p.add_argument("--tokens", type=int, default=16, help="tokens per rank (0 allowed)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="token dtype")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    problem = None
    if args.experts < 1 or args.experts % world:
        problem = f"--experts {args.experts} is not a positive multiple of the world size {world}"
    elif not 1 <= args.top_k <= args.experts:
        problem = f"--top-k {args.top_k} is outside [1, --experts {args.experts}]"
    elif min(args.hidden, args.ffn) < 1 or args.tokens < 0:
        problem = "--hidden and --ffn must be >= 1, --tokens >= 0"
    if problem:
        if rank == 0:
            print(f"moe_layer: {problem}", file=sys.stderr)
        return 2
    dtype = DTYPES[args.dtype]
    local = args.experts // world
    torch.set_num_threads(1)  # the ranks share the machine's cores

    router = make_router(args)
    local_experts = [make_expert(e, args, dtype) for e in range(rank * local, (rank + 1) * local)]
    x = make_tokens(rank, args, dtype)

    out = moe_forward_ep(x, router, local_experts, args, comm)

    # The reference: all experts, all ranks' tokens (each rank routes its own tokens, so the
    # router sees the same rows as on the EP path).
    experts = [make_expert(e, args, dtype) for e in range(args.experts)]
    all_x = comm.allgather(x)
    ref = torch.cat([moe_forward_dense(xr, router, experts, args) for xr in all_x])
    mine = ref[rank * args.tokens : (rank + 1) * args.tokens]

    diff = (out.float() - mine.float()).abs()
    if dtype == torch.float32:
        bound = 2.0**-14 * (1 + mine.abs())
    else:
        bound = 2.0**-5 * (1 + mine.float().abs().amax(dim=1, keepdim=True))
    bad = diff > bound
    ok = not bool(bad.any()) and out.shape == mine.shape and out.dtype == dtype
    if not ok:
        i, j = divmod(int((diff - bound).argmax()), args.hidden)
        print(
            f"moe_layer: rank {rank}: MISMATCH at token {i}, element {j}: EP {float(out[i, j])} "
            f"vs dense {float(mine[i, j])} (|diff| {float(diff[i, j]):.3g} > bound "
            f"{float(bound.expand_as(diff)[i, j]):.3g}); {int(bad.sum())} elements out of bound",
            file=sys.stderr,
            flush=True,
        )
    all_ok = comm.allreduce(int(ok), op=MPI.MIN)
    worst = comm.allreduce(float(diff.max()) if diff.numel() else 0.0, op=MPI.MAX)
    if rank == 0:
        print(
            f"moe_layer: W={world} E={args.experts} L={local} K={args.top_k} H={args.hidden} "
            f"ffn={args.ffn} tokens/rank={args.tokens} {args.dtype}: max |EP - dense| = {worst:.3g}"
        )
        print("PASS" if all_ok else "FAIL", flush=True)
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
