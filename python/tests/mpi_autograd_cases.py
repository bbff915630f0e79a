"""Autograd through moe_ep.torch.dispatch_v2 / combine_v2 (SPEC §6), run under mpirun by
test_autograd_mpi.py: each case prints "CASE name rank=r OK" or "FAIL: ...".

The oracle is the same MoE layer computed densely in one process with plain PyTorch autograd on
the global batch (every rank builds it from one seed): a softmax top-k router, experts
y = tanh(x @ A_e), a shared expert added as shared_expert_x, an optional 2-D mask. The
gradients of x, of the router's and shared expert's weights (summed over ranks, as data
parallelism does) and of each rank's own experts' weights must equal the dense ones within 1e-5
relative (fp32); the bf16 case checks the backward ops' bits against plain torch on the
dispatched rows instead.
"""

from __future__ import annotations

import sys
import time
import traceback
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch
from torch import Tensor

import moe_ep
import moe_ep.torch as mt
from mpi_report import say


@dataclass
class Layer:
    """One MoE layer's global batch and parameters (identical on every rank)."""

    world: int
    h: int
    e: int
    k: int
    bs: List[int]
    x: List[Tensor]
    target: List[Tensor]
    mask: Optional[List[Tensor]]
    router: Tensor
    experts: Tensor  # (E, H, H)
    shared: Tensor  # (H, H)

    @property
    def global_bs(self) -> int:
        return self.world * max(self.bs)


def make_layer(world: int, bs: List[int], *, h=16, experts_per_rank=4, k=3, mask=False,
               seed=7) -> Layer:
    g = torch.Generator().manual_seed(seed)
    e = experts_per_rank * world
    x = [torch.randn(n, h, generator=g) for n in bs]
    target = [torch.randn(n, h, generator=g) for n in bs]
    masks = None
    if mask:  # per entry, every token keeps one (BS differs across ranks)
        masks = []
        for n in bs:
            m = torch.rand(n, k, generator=g) > 0.3
            m[:, 0] = True
            masks.append(m)
    return Layer(world, h, e, k, bs, x, target, masks,
                 router=torch.randn(h, e, generator=g) * 0.5,
                 experts=torch.randn(e, h, h, generator=g) / h**0.5,
                 shared=torch.randn(h, h, generator=g) / h**0.5)


def route(layer: Layer, x: Tensor, router: Tensor):
    probs = torch.softmax(x @ router, dim=-1)
    w, ids = torch.topk(probs, layer.k, dim=-1)
    return w, ids.to(torch.int32)


def dense_grads(layer: Layer):
    """The whole layer in one process: grads of every rank's x, the router, the experts and the
    shared expert."""
    xs = [x.clone().requires_grad_() for x in layer.x]
    router = layer.router.clone().requires_grad_()
    experts = layer.experts.clone().requires_grad_()
    shared = layer.shared.clone().requires_grad_()
    loss = 0
    for r, x in enumerate(xs):
        w, ids = route(layer, x, router)
        out = x @ shared  # the shared expert, then the K terms in k order
        acc = torch.zeros_like(out)
        for kk in range(layer.k):
            y = torch.tanh(torch.einsum("nh,nhj->nj", x, experts[ids[:, kk].long()]))
            term = w[:, kk : kk + 1] * y
            if layer.mask is not None:
                term = term * layer.mask[r][:, kk : kk + 1]
            acc = acc + term
        loss = loss + ((acc + out) * layer.target[r]).sum()
    loss.backward()
    return [x.grad for x in xs], router.grad, experts.grad, shared.grad


def ep_grads(comm, layer: Layer, rank: int, loss_fn=None):
    """The layer over moe-ep on this rank: grads of its x, its share of the router's and shared
    expert's (summed over ranks after), and of the experts it hosts. loss_fn: ep_loss, or a
    compiled form of it."""
    x = layer.x[rank].clone().requires_grad_()
    router = layer.router.clone().requires_grad_()
    experts = layer.experts.clone().requires_grad_()
    shared = layer.shared.clone().requires_grad_()
    (loss_fn or ep_loss)(comm, layer, rank, x, router, experts, shared).backward()
    return x.grad, router.grad, experts.grad, shared.grad


def ep_loss(comm, layer: Layer, rank: int, x, router, experts, shared, async_op=False):
    w, ids = route(layer, x, router)
    mask = layer.mask[rank] if layer.mask is not None else None
    kw = dict(global_bs=layer.global_bs, x_active_mask=mask)
    if async_op:  # started, then waited for: the same op on the graph
        kw["async_op"] = True
    d = mt.dispatch_v2(x, ids, comm, moe_expert_num=layer.e, expert_scales=w.detach(), **kw)
    d = d.wait() if async_op else d
    local = layer.e // layer.world
    counts = d.expert_token_nums.tolist()
    segments, start = [], 0
    for l, n in enumerate(counts):  # this rank's experts on their rows
        rows = d.expand_x[start : start + n]
        segments.append(torch.tanh(rows @ experts[rank * local + l]))
        start += n
    pad = d.expand_x.new_zeros((d.expand_x.shape[0] - start, layer.h))
    y = torch.cat(segments + [pad])
    out = mt.combine_v2(y, ids, d.assist_info_for_combine, d.ep_recv_counts, w, comm,
                        moe_expert_num=layer.e, shared_expert_x=x @ shared, handle=d.handle, **kw)
    out = out.wait() if async_op else out
    return (out * layer.target[rank]).sum()


def allreduce(comm, t: Tensor) -> Tensor:
    from mpi4py import MPI

    buf = t.contiguous().clone()
    comm.Allreduce(MPI.IN_PLACE, buf.numpy(), op=MPI.SUM)
    return buf


def check_close(what: str, got: Tensor, want: Tensor, rtol: float = 1e-5) -> None:
    scale = float(want.abs().max()) if want.numel() else 0.0
    err = float((got - want).abs().max()) if want.numel() else 0.0
    if got.shape != want.shape or err > rtol * max(scale, 1e-30):
        raise AssertionError(f"{what}: max error {err} over {rtol} x {scale} (shape "
                             f"{tuple(got.shape)} vs {tuple(want.shape)})")


def layer_case(comm, layer: Layer, loss_fn=None) -> None:
    rank, world = comm.Get_rank(), comm.Get_size()
    gx, grouter, gexperts, gshared = ep_grads(comm, layer, rank, loss_fn)
    dx, drouter, dexperts, dshared = dense_grads(layer)
    local = layer.e // world
    mine = slice(rank * local, (rank + 1) * local)
    check_close("grad of x", gx, dx[rank])
    check_close("grad of this rank's experts", gexperts[mine], dexperts[mine])
    others = torch.cat([gexperts[: mine.start], gexperts[mine.stop :]])
    if others.numel() and float(others.abs().max()) != 0:
        raise AssertionError("experts of other ranks got a gradient here")
    check_close("grad of the router (summed over ranks)", allreduce(comm, grouter), drouter)
    check_close("grad of the shared expert (summed over ranks)", allreduce(comm, gshared), dshared)


CASES: Dict[str, Callable] = {}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


@case
def layer_even(comm):
    layer_case(comm, make_layer(comm.Get_size(), [5] * comm.Get_size()))


@case
def layer_mask_2d_zero_tokens(comm):
    """The acceptance case: a 2-D mask and the last rank without tokens."""
    w = comm.Get_size()
    bs = [6] * w
    if w > 1:
        bs[-1] = 0
    layer_case(comm, make_layer(w, bs, mask=True, seed=11))


@case
def compiled_layer(comm):
    """The layer's forward and backward traced by torch.compile (AOTAutograd, the eager
    backend: the ops' fakes and their registered backward), against the dense layer. The expert
    loop reads expert_token_nums (a graph break); the communicator is registered first."""
    mt.group_id(comm)
    torch._dynamo.reset()
    w = comm.Get_size()
    layer_case(comm, make_layer(w, [5] * w, mask=True, seed=13),
               torch.compile(ep_loss, backend="aot_eager"))


@case
def async_layer(comm):
    """async_op=True for dispatch_v2 and combine_v2 (include/moe_ep/async.h): the gradients
    against the dense layer, and the loss and every gradient the same bits as the synchronous
    calls'."""
    w = comm.Get_size()
    bs = [4 + r % 3 for r in range(w)]
    layer = make_layer(w, bs, mask=True, seed=17)
    layer_case(comm, layer, lambda *a: ep_loss(*a, async_op=True))
    rank = comm.Get_rank()
    want = ep_grads(comm, layer, rank)
    got = ep_grads(comm, layer, rank, lambda *a: ep_loss(*a, async_op=True))
    for name, g, s in zip(("x", "router", "experts", "shared"), got, want):
        if not torch.equal(g, s):
            raise AssertionError(f"grad of {name}: async differs from sync")


@case
def async_sources_and_errors(comm):
    """DispatchWork.wait_source hands out every source once, its rows already those of the
    finished dispatch; is_completed after wait; a second wait gives the same result; an argument
    error on one rank comes out of wait() there (RemoteError on the others)."""
    rank, world = comm.Get_rank(), comm.Get_size()
    layer = make_layer(world, [6] * world, seed=19)
    w, ids = route(layer, layer.x[rank], layer.router)
    kw = dict(moe_expert_num=layer.e, expert_scales=w)
    want = mt.dispatch_v2(layer.x[rank], ids, comm, **kw)
    work = mt.dispatch_v2(layer.x[rank], ids, comm, async_op=True, **kw)
    seen = []
    while (s := work.wait_source()) is not None:
        seen.append(s.source)
        for off, n in zip(s.offsets, s.rows):
            if not torch.equal(s.expand_x[off:off + n], want.expand_x[off:off + n]):
                raise AssertionError(f"source {s.source}: rows differ when handed out")
    if sorted(seen) != list(range(world)):
        raise AssertionError(f"sources handed out: {seen}")
    got = work.wait()
    if not work.is_completed() or work.wait() is not got:
        raise AssertionError("wait() twice or is_completed() after it")
    valid = int(want.ep_recv_counts[-1])
    if not torch.equal(got.expand_x[:valid], want.expand_x[:valid]):
        raise AssertionError("async expand_x differs")
    # A work dropped before wait(): its op still runs (its inputs kept), and the next call, queued
    # behind it, gives the same outputs. x with strided rows: the binding is given a copy.
    x_dropped = layer.x[rank].t().contiguous().t()
    mt.dispatch_v2(x_dropped, ids, comm, async_op=True, **kw)  # the work is dropped at once
    del x_dropped
    import gc

    gc.collect()
    again = mt.dispatch_v2(layer.x[rank], ids, comm, **kw)
    if not torch.equal(again.expand_x[:valid], want.expand_x[:valid]):
        raise AssertionError("the call after a dropped work differs")
    bad = ids.clone()
    if rank == world - 1:
        bad[0, 0] = layer.e + 3
    work = mt.dispatch_v2(layer.x[rank], bad, comm, async_op=True, **kw)
    try:
        work.wait()
    except moe_ep.Error as e:
        want_kind = moe_ep.InvalidArgumentError if rank == world - 1 else moe_ep.RemoteError
        if not isinstance(e, want_kind) or "expert_ids" not in str(e):
            raise AssertionError(f"{type(e).__name__}: {e}") from e
    else:
        raise AssertionError("a bad expert id went through")
    try:  # a malformed async_op on one rank: through the collective, RemoteError elsewhere
        flag = 1 if rank == world - 1 else True
        work = mt.dispatch_v2(layer.x[rank], ids, comm, async_op=flag, **kw)
        work.wait()
    except moe_ep.Error as e:
        want_kind = moe_ep.InvalidArgumentError if rank == world - 1 else moe_ep.RemoteError
        if (not isinstance(e, want_kind)
                or "dispatch_v2: async_op = 1 (int) must be a bool" not in str(e)):
            raise
    else:
        raise AssertionError("async_op=1 accepted")


@case
def expert_parallel_overlap(comm):
    """ExpertParallel(overlap=True): two micro-batches overlapped, the output and the gradients
    the same bits as the same micro-batches one after the other (overlap="split"), and close to
    the one-batch layer; uneven token counts, one rank with none."""
    from moe_ep.torch.nn import ExpertParallel

    rank, world = comm.Get_rank(), comm.Get_size()
    layer = make_layer(world, [7 - (r % 2) * 3 for r in range(world)], seed=23)
    if world > 1:
        layer.bs[-1] = 0
        layer.x[-1] = layer.x[-1][:0]
    local = layer.e // world

    def run(overlap):
        experts = layer.experts.clone().requires_grad_()

        def fn(x, counts):
            out, start = [], 0
            for l, n in enumerate(counts):
                out.append(torch.tanh(x[start:start + n] @ experts[rank * local + l]))
                start += n
            return torch.cat(out)

        x = layer.x[rank].clone().requires_grad_()
        w, ids = route(layer, x, layer.router)
        out = ExpertParallel(layer.e, fn, comm, overlap=overlap)(x, ids, w.detach())
        out.sum().backward()
        return out.detach(), x.grad, experts.grad

    ovl, split, one = run(True), run("split"), run(False)
    for bad in (1, 0, "yes"):
        try:
            ExpertParallel(layer.e, None, comm, overlap=bad)
        except moe_ep.InvalidArgumentError as e:
            if "must be False, True or 'split'" not in str(e):
                raise
        else:
            raise AssertionError(f"overlap={bad!r} accepted")
    for name, a, b in zip(("output", "grad of x", "grad of the experts"), ovl, split):
        if not torch.equal(a, b):
            raise AssertionError(f"{name}: overlapped differs from split")
    for name, a, b in zip(("output", "grad of x", "grad of the experts"), ovl, one):
        check_close(f"{name} (vs one batch)", a, b)


@case
def special_experts_and_shared_expert_x(comm):
    """combine_v2's other differentiable inputs (SPEC §6): ori_x through copy and const experts,
    the const tables, a 3-D shared_expert_x and expert_scales, with a zero expert and -1 ids,
    against the same combine written in plain torch (fp32, 1e-5 relative)."""
    rank, world = comm.Get_rank(), comm.Get_size()
    e, z, cp, q, h, bs, k = 2 * world, 1, 1, 2, 8, 6, 3
    g = torch.Generator().manual_seed(31 + rank)
    x = torch.randn(bs, h, generator=g)
    ids = torch.stack([torch.randperm(e + z + cp + q, generator=g)[:k] for _ in range(bs)]).int()
    ids[0, 1] = -1  # an inactive entry
    w0 = torch.rand(bs, k, generator=g) + 0.5
    tables = [torch.randn(q, h, generator=torch.Generator().manual_seed(s)) for s in (1, 2, 3)]
    sx0 = torch.randn(2, bs // 2, h, generator=g)
    leaves = [t.clone().requires_grad_() for t in (x, w0, sx0, *tables)]
    xl, w, sx, a1, a2, v = leaves
    special = dict(zero_expert_num=z, copy_expert_num=cp, const_expert_num=q)
    d = mt.dispatch_v2(xl, ids, comm, moe_expert_num=e, expert_scales=w.detach(), **special)
    y = d.expand_x * 3
    out = mt.combine_v2(y, ids, d.assist_info_for_combine, d.ep_recv_counts, w, comm,
                        moe_expert_num=e, shared_expert_x=sx, ori_x=xl, const_expert_alpha_1=a1,
                        const_expert_alpha_2=a2, const_expert_v=v, handle=d.handle, **special)
    target = torch.randn(bs, h, generator=g)
    got = torch.autograd.grad((out * target).sum(), leaves)

    dl = [t.clone().requires_grad_() for t in (x, w0, sx0, *tables)]
    dx, dw, dsx, da1, da2, dv = dl
    acc = torch.zeros(bs, h)
    for kk in range(k):
        for i in range(bs):
            eid = int(ids[i, kk])
            if eid < 0 or e <= eid < e + z:
                continue
            if eid < e:
                val = 3 * dx[i]
            elif eid < e + z + cp:
                val = dx[i]
            else:
                qq = eid - e - z - cp
                val = da1[qq] * dx[i] + da2[qq] * dv[qq]
            acc = acc.index_add(0, torch.tensor([i]), (dw[i, kk] * val)[None])
    dense = acc + dsx.reshape(bs, h)
    want = torch.autograd.grad((dense * target).sum(), dl)
    names = ("x", "expert_scales", "shared_expert_x", "alpha_1", "alpha_2", "v")
    for name, a, b in zip(names, got, want):
        check_close(f"grad of {name}", a, b)


@case
def bf16_bits(comm):
    """bf16: grad_x is the same bits as plain torch computes from the formulas: the gradient
    rows rne(w_k * g) (combine_v2_backward) summed over k in fp32 and rounded once
    (dispatch_v2_backward)."""
    w = comm.Get_size()
    rank = comm.Get_rank()
    layer = make_layer(w, [4] * w, h=8, k=2, seed=5)
    x = layer.x[rank].to(torch.bfloat16).requires_grad_()
    wts, ids = route(layer, layer.x[rank], layer.router)
    d = mt.dispatch_v2(x, ids, comm, moe_expert_num=layer.e, expert_scales=wts)
    y = d.expand_x * 2
    out = mt.combine_v2(y, ids, d.assist_info_for_combine, d.ep_recv_counts, wts, comm,
                        moe_expert_num=layer.e, handle=d.handle)
    out.float().sum().backward()
    # d out / d x = sum_k w_k * 2, rounded twice (w * g into bf16, then the row sum into bf16)
    g_rows = (wts * 1.0).to(torch.bfloat16).float() * 2
    want = g_rows.sum(dim=1, keepdim=True).to(torch.bfloat16).expand_as(x)
    if not torch.equal(x.grad, want):
        raise AssertionError(f"bf16 grad_x {x.grad[:2]} != {want[:2]}")


@case
def combine_without_handle_has_no_backward(comm):
    layer = make_layer(comm.Get_size(), [3] * comm.Get_size())
    rank = comm.Get_rank()
    x = layer.x[rank].clone().requires_grad_()
    w, ids = route(layer, x, layer.router)
    d = mt.dispatch_v2(x, ids, comm, moe_expert_num=layer.e, expert_scales=w.detach())
    out = mt.combine_v2(d.expand_x, ids, d.assist_info_for_combine, d.ep_recv_counts, w.detach(),
                        comm, moe_expert_num=layer.e)
    try:
        out.sum().backward()
    except moe_ep.InvalidArgumentError as e:
        if "needs handle=" not in str(e):
            raise
        return
    raise AssertionError("no error")


@case
def opcheck_differentiable_ops(comm):
    """torch.library.opcheck on the functional dispatch_v2 / combine_v2 with inputs that need a
    gradient (so its autograd and AOT checks run the backward), and on the backward ops. At
    world size 2 only (the op calls do not depend on W). dispatch_v2's AOT check compares the
    meaningful prefixes (mpi_dispatch_cases.opcheck_dispatch's reason)."""
    if comm.Get_size() != 2:
        return
    import torch.utils._pytree as pytree
    from torch.testing._internal.optests.aot_autograd import aot_autograd_check

    from mpi_dispatch_cases import dispatch_prefixes

    rank = comm.Get_rank()
    layer = make_layer(2, [4, 4], h=8, k=2, seed=3)
    gid = mt.group_id(comm)
    x = layer.x[rank].clone().requires_grad_()
    w, ids = route(layer, layer.x[rank], layer.router)
    w = w.detach().requires_grad_()
    d_args = (x, ids, gid, 2, rank, layer.e)
    op = torch.ops.moe_ep._dispatch_v2_functional.default
    rest = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(op, d_args, {"expert_scales": w.detach()}, test_utils=rest)

    def func(*a, **kw):
        # The check's loss is |sum| of each output: the rows past the valid ones (unspecified,
        # SPEC §1.4) are zeroed so that its sign, hence the gradient, depends on the valid ones.
        a, kw = pytree.tree_map_only(Tensor, torch.clone, (a, kw))
        outs = op(*a, **kw)
        valid = outs[4][-1] if outs[4].numel() else 0
        keep = (torch.arange(outs[0].shape[0]) < valid).unsqueeze(1)
        return (outs[0] * keep, *outs[1:])

    def equal(got, want, msg=None):  # the outputs, then (with the same function) the grads
        if len(got) != 8:
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=msg)
            return
        (g, gs), (v, vs) = dispatch_prefixes(got), dispatch_prefixes(want)
        assert gs == vs, f"{msg}: shapes {gs} != {vs}"
        torch.testing.assert_close(g, v, rtol=0, atol=0, msg=msg)

    aot_autograd_check(func, d_args, {"expert_scales": w.detach()}, dynamic=True,
                       check_gradients="auto", assert_equals_fn=equal)

    d = mt.dispatch_v2(x.detach(), ids, comm, moe_expert_num=layer.e, expert_scales=w.detach())
    y = (d.expand_x * 0.5).requires_grad_()
    c_args = (y, ids, None, None, w, gid, 2, rank, layer.e)
    sx = torch.randn(4, 8).requires_grad_()
    torch.library.opcheck(torch.ops.moe_ep._combine_v2_functional.default, c_args,
                          {"shared_expert_x": sx, "handle": d.handle})
    g = torch.randn(4, 8)
    torch.library.opcheck(torch.ops.moe_ep.dispatch_v2_backward.default,
                          (d.expand_x, ids, gid, 2, rank, layer.e), {"handle": d.handle})
    torch.library.opcheck(torch.ops.moe_ep.combine_v2_backward.default,
                          (g, y.detach(), ids, w.detach(), gid, 2, rank, layer.e),
                          {"shared_expert_x": True, "handle": d.handle})


@case
def train_moe_example(comm):
    """examples/python/train_moe.py with its defaults (50 Adam steps): 4 ranks only (it costs
    seconds)."""
    if comm.Get_size() == 4:
        run_example(comm, "train_moe.py")


def run_example(comm, name: str, args=()) -> None:
    """examples/python/<name> as __main__ in this launch (with args): exit status 0 on every
    rank, PASS on rank 0; its output is passed on, one line per write."""
    import contextlib
    import io
    import runpy
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "python" / name
    buf, argv = io.StringIO(), sys.argv
    sys.argv = [str(path), *args]
    try:
        with contextlib.redirect_stdout(buf):
            runpy.run_path(str(path), run_name="__main__")
        status = 0
    except SystemExit as e:
        status = e.code
    finally:
        sys.argv = argv
    lines = buf.getvalue().splitlines()
    for line in lines:
        say(f"{name} rank={comm.Get_rank()}: {line}")
    if status not in (0, None) or (comm.Get_rank() == 0 and not any(
            line.startswith("PASS") for line in lines)):
        raise AssertionError(f"{name} exited with {status!r}: {lines[-3:]}")


@case
def overlap_example(comm):
    """examples/python/overlap.py: the overlapped two-micro-batch layer gives the sequential
    one's bits (small sizes; 2 ranks only)."""
    if comm.Get_size() == 2:
        run_example(comm, "overlap.py", ["--tokens", "24", "--hidden", "64", "--iters", "2"])


@case
def ascend_single_op_example(comm):
    """The seed's single-op example ported to moe_ep.torch_npu (README, "Porting torch_npu
    code"): its combine output equals the dense reference on every rank. 4 ranks only (its E =
    32 experts; it costs seconds)."""
    if comm.Get_size() == 4:
        run_example(comm, "ascend_single_op.py")


@case
def torch_npu_names(comm):
    """moe_ep.torch_npu's ops under torch_npu's names: the same bits as moe_ep.torch's, the
    pair differentiable (the plan kept with ep_recv_counts), a bad group name refused."""
    import moe_ep.torch_npu as torch_npu

    rank, world = comm.Get_rank(), comm.Get_size()
    layer = make_layer(world, [5] * world, h=8, k=2, seed=21)
    name = torch_npu.group_name(comm)
    if torch_npu.group_name(comm) != name:
        raise AssertionError("group_name gave a second name to the same communicator")
    x = layer.x[rank].clone().requires_grad_()
    w, ids = route(layer, layer.x[rank], layer.router)
    w = w.detach().requires_grad_()
    outs = torch_npu.npu_moe_distribute_dispatch_v2(
        x=x, expert_ids=ids, group_ep=name, ep_world_size=world, ep_rank_id=rank,
        moe_expert_num=layer.e, expert_scales=w.detach())
    if len(outs) != 7:
        raise AssertionError(f"dispatch returned {len(outs)} outputs, torch_npu returns 7")
    expand_x, _, assist, _, counts, tp_counts, expand_scales = outs
    y = expand_x * 3
    got = torch_npu.npu_moe_distribute_combine_v2(
        expand_x=y, expert_ids=ids, assist_info_for_combine=assist, ep_send_counts=counts,
        expert_scales=w, group_ep=name, ep_world_size=world, ep_rank_id=rank,
        moe_expert_num=layer.e, tp_send_counts=tp_counts, expand_scales=expand_scales)
    d = mt.dispatch_v2(x.detach(), ids, comm, moe_expert_num=layer.e, expert_scales=w.detach())
    want = mt.combine_v2(d.expand_x * 3, ids, d.assist_info_for_combine, d.ep_recv_counts,
                         w.detach(), comm, moe_expert_num=layer.e)
    if not torch.equal(got.detach(), want):
        raise AssertionError("npu_moe_distribute_combine_v2 differs from moe_ep.torch.combine_v2")
    got.sum().backward()  # d/dx = 3 * sum_k w_k; d/dw_k = sum_h y_k = 3 * sum(x)
    torch.testing.assert_close(x.grad, (3 * w.detach().sum(1, keepdim=True)).expand_as(x))
    torch.testing.assert_close(w.grad, (3 * x.detach().sum(1, keepdim=True)).expand_as(w))
    try:
        torch_npu.npu_moe_distribute_dispatch_v2(x.detach(), ids, "nope", world, rank, layer.e)
    except moe_ep.InvalidArgumentError as e:
        if "group_ep = 'nope' is not a registered group name" not in str(e):
            raise
    else:
        raise AssertionError("an unknown group name was accepted")
    permuted, sorted_indices = torch_npu.npu_moe_token_permute(layer.x[rank], ids)
    back = torch_npu.npu_moe_token_unpermute(permuted, sorted_indices, w.detach())
    torch.testing.assert_close(back, layer.x[rank] * w.detach().sum(1, keepdim=True))


def main(argv) -> int:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    torch.set_num_threads(1)
    failed = 0
    for name in list(argv) or list(CASES):
        t0 = time.perf_counter()
        try:
            CASES[name](comm)
            say(f"CASE {name} rank={comm.Get_rank()} OK ({time.perf_counter() - t0:.2f} s)")
        except Exception as err:  # report and go on: the other ranks made the same calls
            failed += 1
            why = f"{type(err).__name__}: {err}".replace("\n", " | ")
            say(f"CASE {name} rank={comm.Get_rank()} FAIL: {why}")
            traceback.print_exc()
    say(f"DONE rank={comm.Get_rank()} failed={failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
