"""Training a small MoE transformer block with expert parallelism (SPEC §6): the same model trained
over MPI with moe_ep.torch.dispatch_v2 / combine_v2 and in one process with plain PyTorch (dense,
no moe-ep), step by step; PASS when the two loss curves agree at every step within --rtol and
the loss falls.

Run (any world size W that divides --experts; mpi4py and the moe_ep package installed):

    mpirun -n 4 --oversubscribe python examples/python/train_moe.py
    mpirun -n 2 python examples/python/train_moe.py --optimizer sgd --steps 20
    python examples/python/train_moe.py             # W = 1

The block: y = x + MoE(rmsnorm(x)), where MoE is a softmax top-k router (weights renormalised
to sum to 1), E SwiGLU experts and one shared SwiGLU expert (added as combine_v2's
shared_expert_x); the loss is the mean squared error against a fixed random target map.

How the work is split: rank r holds the tokens [r*T, (r+1)*T) of each step's global batch and
hosts experts [r*L, (r+1)*L). The router, the norm and the shared expert are replicated: their
gradients are summed over ranks (MPI Allreduce, as data parallelism does) before the step. An
expert's gradient arrives on its host only (dispatch_v2 / combine_v2's backward bring every
token's contribution there), so each rank steps its own experts. Every rank also trains the dense
model, on the whole batch, and compares.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from mpi4py import MPI

import moe_ep.torch as moe_torch


def init_params(hidden: int, ffn: int, experts: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)

    def w(*shape, fan_in):
        return torch.randn(*shape, generator=g) / fan_in**0.5

    return {
        "norm": torch.ones(hidden),
        "router": w(experts, hidden, fan_in=hidden),
        "w1": w(experts, ffn, hidden, fan_in=hidden),  # gate
        "w3": w(experts, ffn, hidden, fan_in=hidden),  # up
        "w2": w(experts, hidden, ffn, fan_in=ffn),  # down
        "s1": w(ffn, hidden, fan_in=hidden),
        "s3": w(ffn, hidden, fan_in=hidden),
        "s2": w(hidden, ffn, fan_in=ffn),
    }


def swiglu(x, w1, w3, w2):
    return (F.silu(x @ w1.T) * (x @ w3.T)) @ w2.T


def rmsnorm(x, weight):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight


def route(h, router, top_k):
    probs = torch.softmax(h @ router.T, dim=-1)
    w, ids = torch.topk(probs, top_k, dim=-1)
    return w / w.sum(-1, keepdim=True), ids.to(torch.int32)


def block_dense(p: dict, x, top_k):
    """The whole block in one process: each token's experts in k order, then the shared one."""
    h = rmsnorm(x, p["norm"])
    w, ids = route(h, p["router"], top_k)
    acc = torch.zeros_like(h)
    for k in range(top_k):
        y = torch.zeros_like(h)
        for e in ids[:, k].unique().tolist():
            rows = ids[:, k] == e
            y = y.index_put((rows,), swiglu(h[rows], p["w1"][e], p["w3"][e], p["w2"][e]))
        acc = acc + w[:, k : k + 1] * y
    return x + (acc + swiglu(h, p["s1"], p["s3"], p["s2"]))


def block_ep(comm, p: dict, x, top_k):
    """The block on this rank's tokens, its experts hosted here."""
    rank, world = comm.Get_rank(), comm.Get_size()
    experts = p["router"].shape[0]
    local = experts // world
    h = rmsnorm(x, p["norm"])
    w, ids = route(h, p["router"], top_k)
    d = moe_torch.dispatch_v2(h, ids, comm, moe_expert_num=experts, expert_scales=w.detach())
    outs, start = [], 0
    for l, n in enumerate(d.expert_token_nums.tolist()):
        e = rank * local + l
        outs.append(swiglu(d.expand_x[start : start + n], p["w1"][e], p["w3"][e], p["w2"][e]))
        start += n
    outs.append(d.expand_x.new_zeros((d.expand_x.shape[0] - start, x.shape[1])))
    shared = swiglu(h, p["s1"], p["s3"], p["s2"])
    y = moe_torch.combine_v2(torch.cat(outs), ids, d.assist_info_for_combine, d.ep_recv_counts, w,
                             comm, moe_expert_num=experts, shared_expert_x=shared,
                             handle=d.handle)
    return x + y


def batch(step: int, tokens: int, hidden: int, target_map):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(tokens, hidden, generator=g)
    return x, torch.tanh(x @ target_map)


def make_optimizer(name: str, params, lr: float):
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--tokens", type=int, default=16, help="tokens per rank per step")
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--ffn", type=int, default=64)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--rtol", type=float, default=1e-5)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    if a.experts % world:
        if rank == 0:
            print(f"train_moe.py: --experts {a.experts} is not a multiple of the {world} ranks")
        return 2
    torch.manual_seed(a.seed)
    local = a.experts // world
    mine = slice(rank * local, (rank + 1) * local)
    replicated = ("norm", "router", "s1", "s3", "s2")

    ep = {k: v.clone().requires_grad_() for k, v in init_params(a.hidden, a.ffn, a.experts,
                                                                 a.seed).items()}
    dense = {k: v.clone().requires_grad_() for k, v in init_params(a.hidden, a.ffn, a.experts,
                                                                   a.seed).items()}
    opt_ep = make_optimizer(a.optimizer, ep.values(), a.lr)
    opt_dense = make_optimizer(a.optimizer, dense.values(), a.lr)
    target_map = torch.randn(a.hidden, a.hidden, generator=torch.Generator().manual_seed(a.seed))
    total = world * a.tokens

    curve_ep, curve_dense = [], []
    for step in range(a.steps):
        x, target = batch(step, total, a.hidden, target_map)
        rows = slice(rank * a.tokens, (rank + 1) * a.tokens)

        opt_ep.zero_grad()
        out = block_ep(comm, ep, x[rows], a.top_k)
        part = ((out - target[rows]) ** 2).sum() / (total * a.hidden)
        part.backward()
        for k in replicated:  # data parallelism for the replicated parameters
            comm.Allreduce(MPI.IN_PLACE, ep[k].grad.numpy(), op=MPI.SUM)
        for k in ("w1", "w3", "w2"):  # only the hosted experts have a gradient here
            ep[k].grad[: mine.start] = 0
            ep[k].grad[mine.stop :] = 0
        opt_ep.step()
        curve_ep.append(comm.allreduce(float(part.detach()), op=MPI.SUM))

        opt_dense.zero_grad()
        loss = F.mse_loss(block_dense(dense, x, a.top_k), target)
        loss.backward()
        opt_dense.step()
        curve_dense.append(float(loss.detach()))

    worst = max(abs(e - d) / abs(d) for e, d in zip(curve_ep, curve_dense))
    falls = curve_ep[-1] < curve_ep[0]
    ok = worst <= a.rtol and falls
    oks = comm.allgather(ok)
    if rank == 0:
        print(f"train_moe.py: W = {world}, {a.experts} experts top-{a.top_k}, H {a.hidden}, "
              f"{a.tokens} tokens/rank, {a.optimizer} lr {a.lr}, {a.steps} steps")
        print(" step   loss (moe-ep, W ranks)   loss (dense, 1 process)   rel. diff")
        for s, (e, d) in enumerate(zip(curve_ep, curve_dense)):
            print(f"{s:5d}   {e:22.9g}   {d:23.9g}   {abs(e - d) / abs(d):9.2e}")
        print(f"worst relative difference {worst:.2e} (bound {a.rtol:g}); loss "
              f"{curve_ep[0]:.6g} -> {curve_ep[-1]:.6g}")
        print("PASS" if all(oks) else "FAIL")
    return 0 if all(oks) else 1


if __name__ == "__main__":
    sys.exit(main())
