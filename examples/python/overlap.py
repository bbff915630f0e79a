"""A MoE layer of two micro-batches whose dispatch and combine travel while the other's experts
compute (dispatch_v2 / combine_v2 with async_op=True), against the same layer run one step after
another, on the same routing in the same run.

Run (any world size that divides the experts; across machines the overlap pays most):

    mpirun -n 2 python examples/python/overlap.py
    scripts/netns-cluster.sh with 2 1gbit -- 4 .venv/bin/python examples/python/overlap.py

Each micro-batch: a softmax top-k router -> dispatch_v2 -> SwiGLU experts (this rank's, torch
matmuls) -> combine_v2. Sequential: micro-batch 0, then micro-batch 1. Overlapped: both
dispatches started at once; micro-batch 0's experts run on each source's rows as they land
(DispatchWork.wait_source) while its late sources and micro-batch 1's dispatch travel; its
combine is started at once and travels during micro-batch 1's experts. The check, on every rank:
both give the same bits; the last line is PASS/FAIL with the p50 layer times and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from mpi4py import MPI

import moe_ep.torch as mt


def make_batch(rank: int, mb: int, tokens: int, hidden: int, experts: int, top_k: int):
    g = torch.Generator().manual_seed(1000 * mb + rank)
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    router = torch.randn(hidden, experts, generator=torch.Generator().manual_seed(7))
    w, ids = torch.softmax(x.float() @ router, -1).topk(top_k)
    return x, ids.int(), (w / w.sum(-1, keepdim=True)).float()


class Experts:
    """This rank's SwiGLU experts; rows [offset, offset + n) of expand_x belong to local expert l."""

    def __init__(self, local: int, hidden: int, ffn: int):
        g = torch.Generator().manual_seed(11)
        self.w13 = torch.randn(local, hidden, 2 * ffn, generator=g) / hidden ** 0.5
        self.w2 = torch.randn(local, ffn, hidden, generator=g) / ffn ** 0.5

    def rows(self, x: torch.Tensor, y: torch.Tensor, l: int, offset: int, n: int) -> None:
        if n:
            h = x[offset:offset + n].float() @ self.w13[l]
            gate, up = h.chunk(2, -1)
            y[offset:offset + n] = ((torch.nn.functional.silu(gate) * up) @ self.w2[l]).to(y.dtype)

    def source(self, x, y, offsets, rows) -> None:
        for l, (offset, n) in enumerate(zip(offsets, rows)):
            self.rows(x, y, l, offset, n)

    def all(self, d, world: int) -> torch.Tensor:
        """Every source's blocks, in source order (the blocks the overlapped layer computes)."""
        y = torch.empty_like(d.expand_x)
        ends = d.ep_recv_counts.view(-1, world)  # (L, W): inclusive ends of each (l, source)
        flat = d.ep_recv_counts.tolist()
        for s in range(world):
            offsets, rows = [], []
            for l in range(ends.shape[0]):
                b = l * world + s
                n = flat[b] - (flat[b - 1] if b else 0)
                offsets.append(flat[b] - n)
                rows.append(n)
            self.source(d.expand_x, y, offsets, rows)
        return y


def sequential(comm, batches, experts, kw):
    out = []
    for x, ids, w in batches:
        d = mt.dispatch_v2(x, ids, comm, expert_scales=w, **kw)
        y = experts.all(d, comm.Get_size())
        out.append(mt.combine_v2(y, ids, None, None, w, comm, handle=d.handle, **kw))
    return out


def overlapped(comm, batches, experts, kw):
    works = [mt.dispatch_v2(x, ids, comm, expert_scales=w, async_op=True, **kw)
             for x, ids, w in batches]
    combines = []
    for work, (x, ids, w) in zip(works, batches):
        y = None
        while (s := work.wait_source()) is not None:  # experts on each source as it lands
            if y is None:
                y = torch.empty_like(s.expand_x)
            experts.source(s.expand_x, y, s.offsets, s.rows)
        d = work.wait()
        combines.append(mt.combine_v2(y, ids, None, None, w, comm, handle=d.handle,
                                      async_op=True, **kw))
    return [c.wait() for c in combines]


def timed(comm, fn):
    comm.Barrier()
    start = time.perf_counter()
    out = fn()
    return out, comm.allreduce(time.perf_counter() - start, op=MPI.MAX)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=128, help="tokens per micro-batch and rank")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=256, help="the experts' intermediate size")
    ap.add_argument("--iters", type=int, default=10)
    a = ap.parse_args(argv)
    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    torch.set_num_threads(1)  # the ranks fill the cores
    batches = [make_batch(rank, mb, a.tokens, a.hidden, a.experts, a.top_k) for mb in range(2)]
    experts = Experts(a.experts // world, a.hidden, a.ffn)
    kw = dict(moe_expert_num=a.experts)
    seq, ovl, same = [], [], True
    for it in range(a.iters + 1):  # the first is a warm-up
        want, t_seq = timed(comm, lambda: sequential(comm, batches, experts, kw))
        got, t_ovl = timed(comm, lambda: overlapped(comm, batches, experts, kw))
        same = same and all(torch.equal(g, w) for g, w in zip(got, want))
        if it:
            seq.append(t_seq)
            ovl.append(t_ovl)
    ok = comm.allreduce(int(same), op=MPI.MIN) == 1
    if rank == 0:
        s, o = statistics.median(seq) * 1e3, statistics.median(ovl) * 1e3
        print(f"overlap.py: W = {world}, {a.tokens} tokens x 2 micro-batches per rank, H "
              f"{a.hidden}, E {a.experts}, top-{a.top_k}, ffn {a.ffn}")
        print(f"{'PASS' if ok else 'FAIL'} sequential {s:.2f} ms, overlapped {o:.2f} ms (p50 of "
              f"{a.iters}), ratio {o / s:.3f}; outputs {'bitwise equal' if same else 'DIFFER'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
