"""dispatch_v2 / combine_v2 cases run under mpirun by test_dispatch_mpi.py (one launch per world
size runs every case):

    mpirun -n 4 --oversubscribe python python/tests/mpi_dispatch_cases.py [CASE ...]

Every rank prints one line per case, ``CASE <name> rank=<r> OK`` or ``CASE <name> rank=<r> FAIL:
<why>``, then ``DONE rank=<r> failed=<n>``, and exits 1 when a case failed on it.

The oracle is independent of moe_ep: every rank regenerates every rank's inputs from per-rank
seeds and computes in plain torch
  - the rows this rank must receive, in SPEC §1.4's order (all ranks' entries in (rank, token,
    slot) order, stably sorted by expert id; on a shared-expert rank one block per source rank),
    expert_token_nums, ep_recv_counts (inclusive, expert major, source minor), the
    (source rank, token, slot) triples of assist_info_for_combine and expand_scales;
  - SPEC §2.3's weighted sum for this rank's tokens: fp32, entries in k order, each product
    rounded to fp32 before it is added, then the shared experts, one rounding to the output dtype
    (each torch op below is one elementwise IEEE operation, so the result is exact); with §2.2's
    zero / copy / const experts in their slots, with comm_quant_mode 2's dequantised rows (and
    dispatch.h's bound against the unquantised sum), with tp_world_size 2's partial expert
    outputs summed in fp32 and rounded once; under elastic_info scale-in, the oracle of the
    smaller world.
Experts are elementwise (expert e multiplies its rows by coef(e), 1 for some: identity), so the
expected combine output is bitwise determined; the comparisons are of bit patterns.

Collectives stay in step: every case makes the same op calls on every rank, and a case that goes
on after a check first agrees on the outcome (agreed()), so a failure on one rank fails the case
on all of them instead of leaving the others waiting. Each round trip also runs the ops' fake
implementations on the same arguments and compares their shapes and dtypes with the real outputs.
"""

from __future__ import annotations

import sys
import time
import traceback
from dataclasses import dataclass, replace
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensorMode

import moe_ep
import moe_ep.torch as mt
from mpi_report import say

# ---------------------------------------------------------------------------------------------
# Inputs, regenerated identically on every rank from (seed, rank).


@dataclass(frozen=True)
class Spec:
    seed: int
    bs: Tuple[int, ...]  # tokens per rank (length W)
    k: int
    e: int  # moe_expert_num
    dtype: torch.dtype = torch.float32
    h: int = 24
    p_off: float = 0.0  # probability that an entry is -1 (inactive)
    mask: str = ""  # "", "1d", "2d": an x_active_mask
    skew: bool = False  # slot 0 of every token is expert 0
    s: int = 0  # shared_expert_rank_num
    ns: int = 1  # shared_expert_num
    global_bs: int = 0
    smooth: bool = False  # quant_mode 2 smoothing scales
    strided: bool = False  # x every other row of a wider buffer; expert_ids, weights transposed
    z: int = 0  # zero_expert_num: ids [E, E+Z)
    c: int = 0  # copy_expert_num: ids [E+Z, E+Z+C)
    q: int = 0  # const_expert_num: ids [E+Z+C, E+Z+C+Q)

    @property
    def n_ids(self) -> int:
        """Every expert id a token may pick: MoE and special experts (SPEC §1.3)."""
        return self.e + self.z + self.c + self.q


@dataclass
class Inputs:
    x: Tensor  # (BS, H)
    ids: Tensor  # (BS, K) int32
    w: Tensor  # (BS, K) fp32 expert_scales
    mask: Optional[Tensor]  # x_active_mask or None
    ori_x: Optional[Tensor] = None  # (BS, H) combine_v2's ori_x, with copy or const experts

    def entry_active(self, i: int, k: int) -> bool:
        if int(self.ids[i, k]) < 0:
            return False
        if self.mask is None:
            return True
        return bool(self.mask[i]) if self.mask.dim() == 1 else bool(self.mask[i, k])

    def token_active(self, i: int) -> bool:
        return any(self.entry_active(i, k) for k in range(self.ids.shape[1]))


def make_inputs(spec: Spec, rank: int) -> Inputs:
    g = torch.Generator().manual_seed(spec.seed * 1_000_003 + rank)
    bs, k, e = spec.bs[rank], spec.k, spec.n_ids
    assert not (spec.skew and spec.n_ids != spec.e), "skew is for MoE experts only"
    x = torch.randn(bs, spec.h, generator=g).to(spec.dtype)
    ids = torch.empty(bs, k, dtype=torch.int32)
    for i in range(bs):
        if spec.skew:
            rest = torch.randperm(e - 1, generator=g)[: k - 1] + 1
            ids[i] = torch.cat([torch.zeros(1, dtype=torch.int64), rest]).to(torch.int32)
        else:
            ids[i] = torch.randperm(e, generator=g)[:k].to(torch.int32)
    if spec.p_off:
        ids[torch.rand(bs, k, generator=g) < spec.p_off] = -1
    w = torch.randn(bs, k, generator=g)
    mask = None
    if spec.mask == "1d":
        n = int(torch.randint(0, bs + 1, (1,), generator=g)) if bs else 0
        mask = torch.arange(bs) < n
    elif spec.mask == "2d":
        mask = torch.rand(bs, k, generator=g) < 0.6
        if bs:
            mask[0] = False  # a token sent nowhere, not even to shared experts
    # ori_x (SPEC §2.1, "the tokens before the experts"): values of its own, not x's, so that a
    # copy/const expert reading the wrong tensor cannot look right; drawn last, so the other
    # inputs of a spec without special experts are unchanged
    ori_x = torch.randn(bs, spec.h, generator=g).to(spec.dtype) if spec.c or spec.q else None
    if spec.strided:  # the same values in non-contiguous tensors
        def strided(t):
            buf = torch.full((2 * bs, spec.h + 3), float("nan"), dtype=spec.dtype)
            buf[::2, : spec.h] = t
            return buf[::2, : spec.h]

        x = strided(x)
        ori_x = strided(ori_x) if ori_x is not None else None
        ids, w = ids.t().contiguous().t(), w.t().contiguous().t()
    return Inputs(x, ids, w, mask, ori_x)


def const_params(spec: Spec) -> Tuple[Tensor, Tensor, Tensor]:
    """const_expert_alpha_1, const_expert_alpha_2, const_expert_v: (Q, H) each, expand_x's dtype,
    the same on every rank."""
    g = torch.Generator().manual_seed(spec.seed + 77)
    return tuple(torch.randn(spec.q, spec.h, generator=g).to(spec.dtype) for _ in range(3))


def special_kwargs(spec: Spec) -> dict:
    """zero/copy/const_expert_num, for both ops."""
    return dict(zero_expert_num=spec.z, copy_expert_num=spec.c, const_expert_num=spec.q)


def special_combine_kwargs(spec: Spec, inp: Inputs) -> dict:
    """combine_v2's ori_x and const expert tensors (only those the spec needs)."""
    kw = {}
    if spec.c or spec.q:
        kw["ori_x"] = inp.ori_x
    if spec.q:
        a1, a2, v = const_params(spec)
        kw.update(const_expert_alpha_1=a1, const_expert_alpha_2=a2, const_expert_v=v)
    return kw


def smooth_scales(spec: Spec) -> Tensor:
    """quant_mode 2 smoothing scales: (Ns + E, H) with shared-expert ranks, else (E, H)."""
    rows = spec.e + (spec.ns if spec.s else 0)
    g = torch.Generator().manual_seed(spec.seed + 99)
    return torch.rand(rows, spec.h, generator=g) + 0.5


def smooth_row(spec: Spec, expert: int) -> int:
    """The row of the smoothing scales for MoE expert e >= 0 or shared expert s (expert -1 - s):
    SPEC §1.3, row Ns + e (row e without shared-expert ranks), row s."""
    if expert < 0:
        return -1 - expert
    return expert + (spec.ns if spec.s else 0)


def coef(e: int) -> float:
    """MoE expert e multiplies its rows by coef(e) (exact in bf16/fp16; 1 = identity)."""
    return (1.0, 0.5, -1.25, 2.0, 0.75)[e % 5]


SHARED_COEF = (0.25, -0.5, 1.5, 3.0)  # shared expert s multiplies by SHARED_COEF[s]

# ---------------------------------------------------------------------------------------------
# The reference (SPEC §1.2, §1.4, §1.5, §2.3).


@dataclass
class Row:
    src: int
    token: int
    slot: int  # k, or K + s for a shared-expert copy
    block: int  # local expert (0 on a shared-expert rank)
    expert: int  # global MoE expert id, or -1 - s for shared expert s


def local_num(spec: Spec, world: int, rank: int) -> int:
    return 1 if rank < spec.s else spec.e // (world - spec.s)


def capacity(spec: Spec, world: int, rank: int) -> int:
    """A of SPEC §1.4."""
    g = spec.global_bs or spec.bs[0] * world
    if rank < spec.s:
        per = spec.s // spec.ns
        return (g // world) * -(-world // per)
    return g * min(local_num(spec, world, rank), spec.k)


def expected_rows(spec: Spec, world: int, rank: int, all_in: Sequence[Inputs]) -> List[Row]:
    rows: List[Row] = []
    if rank < spec.s:  # shared-expert rank: hosts shared expert rank // (S/Ns)
        per = spec.s // spec.ns
        s = rank // per
        for src in range(world):
            if src % per != rank % per:
                continue
            for i in range(all_in[src].ids.shape[0]):
                if all_in[src].token_active(i):
                    rows.append(Row(src, i, spec.k + s, 0, -1 - s))
        return rows
    L = local_num(spec, world, rank)
    first = (rank - spec.s) * L
    for src in range(world):  # (rank, token, slot) order, then a stable sort by expert
        inp = all_in[src]
        for i in range(inp.ids.shape[0]):
            for k in range(spec.k):
                e = int(inp.ids[i, k])
                if inp.entry_active(i, k) and first <= e < first + L:
                    rows.append(Row(src, i, k, e - first, e))
    rows.sort(key=lambda r: r.block)
    return rows


def ref_quant(xf: Tensor) -> Tuple[Tensor, Tensor]:
    """SPEC §1.5 on one fp32 row: (q int8, dynamic scale 1/s fp32)."""
    amax = xf.abs().max()
    if float(amax) == 0.0:
        return torch.zeros_like(xf, dtype=torch.int8), torch.zeros((), dtype=torch.float32)
    s = torch.tensor(127.0, dtype=torch.float32) / amax
    q = torch.round(xf * s).to(torch.int8)  # torch.round: half to even
    return q, torch.tensor(1.0, dtype=torch.float32) / s


def expert_row(spec: Spec, row: Row, x_row: Tensor, quant: bool, smooth: Optional[Tensor]):
    """What the expert writes for `row`: coef * (x_row, or its dequantised int8 copy)."""
    if quant:
        xf = x_row.float()
        if smooth is not None:
            xf = xf * smooth[smooth_row(spec, row.expert)]
        q, ds = ref_quant(xf)
        x_row = (q.float() * ds).to(spec.dtype)
    c = SHARED_COEF[-1 - row.expert] if row.expert < 0 else coef(row.expert)
    return x_row * c


def ref_travel(y: Tensor, comm_quant: bool) -> Tensor:
    """An expert output row as combine_v2 adds it, fp32: y itself, or with comm_quant_mode 2 (SPEC
    §2.1, §2.3) its SPEC §1.5 int8 copy dequantised, fl(q * scale) (no smoothing)."""
    if not comm_quant:
        return y.float()
    q, ds = ref_quant(y.float())
    return q.float() * ds


def ref_combine(spec: Spec, inp: Inputs, quant=False, smooth=None, comm_quant=False,
                expert: Optional[Callable[[Row, Tensor], Tensor]] = None) -> Tensor:
    """SPEC §2.3 with §2.2's special experts for one rank's tokens. expert(row, x_row): the
    output row of a MoE or shared expert (default expert_row: coef, after quant_mode 2)."""
    if expert is None:
        expert = lambda row, x_row: expert_row(spec, row, x_row, quant, smooth)  # noqa: E731
    bs, k = inp.ids.shape
    E, Z, C = spec.e, spec.z, spec.c
    a1, a2, v = const_params(spec) if spec.q else (None, None, None)
    out = torch.zeros(bs, spec.h, dtype=spec.dtype)
    for i in range(bs):
        if not inp.token_active(i):
            continue
        acc = torch.zeros(spec.h, dtype=torch.float32)
        for kk in range(k):
            if not inp.entry_active(i, kk):
                continue
            e, w = int(inp.ids[i, kk]), inp.w[i, kk]
            if e < E:  # MoE expert
                y = expert(Row(-1, i, kk, 0, e), inp.x[i])
                acc = acc + w * ref_travel(y, comm_quant)
            elif e < E + Z:  # zero expert: nothing
                pass
            elif e < E + Z + C:  # copy expert: w * ori_x[i]
                acc = acc + w * inp.ori_x[i].float()
            else:  # const expert q: w * (alpha_1[q] * ori_x[i] + alpha_2[q] * v[q])
                q = e - (E + Z + C)
                c = a1[q].float() * inp.ori_x[i].float() + a2[q].float() * v[q].float()
                acc = acc + w * c
        if spec.s:
            for s in range(spec.ns):
                y = expert(Row(-1, i, k + s, 0, -1 - s), inp.x[i])
                acc = acc + ref_travel(y, comm_quant)
        out[i] = acc.to(spec.dtype)
    return out


def comm_quant_bounds(spec: Spec, inp: Inputs, quant=False, smooth=None) -> List[float]:
    """Per token, how far combine_v2 with comm_quant_mode 2 may be from the unquantised SPEC §2.3
    sum (include/moe_ep/dispatch.h, comm_quant_mode): sum over the travelling rows (MoE entries
    with their |w|, shared experts with 1) of |w| (max|y| / 254 (1 + 2^-14) + 2^-143), plus the
    fp32 rounding of both sums (n + 1 rounded products and adds per element, each within 2^-24 of
    the running magnitude, bounded by `mass`, on each side), plus the final rounding of both
    sides to the output dtype (half an ulp: 2^-8 bf16, 2^-11 fp16 relative, with fp16's
    subnormal half step; fp32 is stored as computed)."""
    u, tiny = {torch.float32: (0.0, 0.0), torch.bfloat16: (2.0**-8, 2.0**-134),
               torch.float16: (2.0**-11, 2.0**-25)}[spec.dtype]
    E, Z, C = spec.e, spec.z, spec.c
    a1, a2, v = const_params(spec) if spec.q else (None, None, None)
    bounds = []
    for i in range(inp.ids.shape[0]):
        if not inp.token_active(i):
            bounds.append(0.0)
            continue
        quant_err = mass = 0.0
        n = 0
        terms = []  # (|w|, max|row|, travels)
        for kk in range(spec.k):
            if not inp.entry_active(i, kk):
                continue
            e, w = int(inp.ids[i, kk]), abs(float(inp.w[i, kk]))
            if e < E:
                y = expert_row(spec, Row(-1, i, kk, 0, e), inp.x[i], quant, smooth)
                terms.append((w, float(y.float().abs().max()), True))
            elif e < E + Z:
                pass
            elif e < E + Z + C:
                terms.append((w, float(inp.ori_x[i].float().abs().max()), False))
            else:
                q = e - (E + Z + C)
                c = a1[q].float() * inp.ori_x[i].float() + a2[q].float() * v[q].float()
                terms.append((w, float(c.abs().max()), False))
        for s in range(spec.ns if spec.s else 0):
            y = expert_row(spec, Row(-1, i, spec.k + s, 0, -1 - s), inp.x[i], quant, smooth)
            terms.append((1.0, float(y.float().abs().max()), True))
        for w, ymax, travels in terms:
            if travels:
                quant_err += w * (ymax / 254 * (1 + 2.0**-14) + 2.0**-143)
            mass += w * ymax * (1 + 2.0**-7)  # a dequantised row is at most ymax (1 + 1/254)
            n += 1
        b = quant_err + 2 * (n + 1) * 2.0**-24 * mass
        b += 2 * (u * (mass + b) + tiny)
        bounds.append(b)
    return bounds


# ---------------------------------------------------------------------------------------------
# Checks.


class CaseFailure(AssertionError):
    pass


def check(cond: bool, msg: Callable[[], str] | str) -> None:
    if not cond:
        raise CaseFailure(msg() if callable(msg) else msg)


def bits(t: Tensor) -> Tensor:
    """The bit patterns of a float tensor (so -0 != +0 and NaN == NaN)."""
    view = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
    return t.contiguous().view(view[t.dtype]) if t.dtype in view else t


def check_bitwise(what: str, got: Tensor, want: Tensor) -> None:
    check(got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}")
    check(got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}")
    diff = bits(got) != bits(want)
    if diff.any():
        idx = tuple(int(v) for v in diff.nonzero()[0])
        raise CaseFailure(
            f"{what}: {int(diff.sum())} elements differ, first at {idx}: got {got[idx].item()!r}, "
            f"want {want[idx].item()!r}"
        )


def check_dispatch(spec, world, rank, all_in, out, etn_type=1, quant=False, smooth=None,
                   exact=False):
    """Checks dispatch_v2's outputs against the reference layout; returns the expected rows.
    exact: exact_size=True, so the row outputs hold the n rows received instead of A."""
    expand_x, dyn, assist, etn, recv, tp_recv, exp_scales = out
    rows = expected_rows(spec, world, rank, all_in)
    a, L, h, n = capacity(spec, world, rank), local_num(spec, world, rank), spec.h, len(rows)
    if exact:
        a = n
    mine = all_in[rank]
    check(
        tuple(expand_x.shape) == (a, h),
        lambda: f"expand_x shape {tuple(expand_x.shape)} != (A={a}, H={h})",
    )
    check(expand_x.dtype == (torch.int8 if quant else spec.dtype), f"expand_x {expand_x.dtype}")
    check(
        tuple(dyn.shape) == ((a,) if quant else (0,)) and dyn.dtype == torch.float32,
        lambda: f"dynamic_scales {tuple(dyn.shape)} {dyn.dtype}",
    )
    bsk = mine.ids.shape[0] * spec.k
    check(
        tuple(assist.shape) == ((3 * n,) if exact else (max(bsk, a * 128),))
        and assist.dtype == torch.int32,
        lambda: f"assist_info_for_combine {tuple(assist.shape)} {assist.dtype}",
    )
    check(tuple(tp_recv.shape) == (1,) and int(tp_recv[0]) == n, f"tp_recv_counts {tp_recv}")
    check(
        tuple(exp_scales.shape) == (a,) and exp_scales.dtype == torch.float32,
        f"expand_scales {tuple(exp_scales.shape)}",
    )
    # Counts: blocks (local expert major, source rank minor), inclusive running sum.
    blocks = torch.zeros(L, world, dtype=torch.int64)
    for r in rows:
        blocks[r.block, r.src] += 1
    want_recv = blocks.flatten().cumsum(0).to(torch.int32)
    check_bitwise("ep_recv_counts", recv, want_recv)
    per_expert = blocks.sum(1)
    want_etn = per_expert if etn_type == 1 else per_expert.cumsum(0)
    check_bitwise(f"expert_token_nums (type {etn_type})", etn, want_etn)
    # Rows, in order.
    got_meta = assist[: 3 * n].view(n, 3) if n else torch.empty(0, 3, dtype=torch.int32)
    want_meta = torch.tensor([[r.src, r.token, r.slot] for r in rows], dtype=torch.int32)
    check_bitwise("assist_info_for_combine (source, token, slot)", got_meta, want_meta.view(n, 3))
    if n == 0:
        return rows
    want_x = torch.stack([all_in[r.src].x[r.token] for r in rows])
    want_w = torch.tensor(
        [float(all_in[r.src].w[r.token, r.slot]) if r.expert >= 0 else 0.0 for r in rows]
    )
    check_bitwise("expand_scales", exp_scales[:n], want_w)
    if not quant:
        check_bitwise("expand_x rows", expand_x[:n], want_x)
        return rows
    # quant_mode 2: SPEC §1.5 bitwise, and the documented dequantisation bound.
    for j, r in enumerate(rows):
        xf = all_in[r.src].x[r.token].float()
        if smooth is not None:
            xf = xf * smooth[smooth_row(spec, r.expert)]
        q, ds = ref_quant(xf)
        check_bitwise(f"expand_x int8 row {j} ({r})", expand_x[j], q)
        check_bitwise(f"dynamic_scales[{j}]", dyn[j], ds)
        deq = expand_x[j].float() * dyn[j]
        bound = float(xf.abs().max()) / 254 * (1 + 2**-14) + 2**-143
        err = float((deq - xf).abs().max())
        check(err <= bound, f"row {j}: dequantised error {err} > bound {bound}")
    return rows


def fake_run(op, args, kwargs):
    """The op's fake implementation on fake copies of the arguments (no communication):
    [(shape, dtype)] of its outputs. With exact_size the row counts are data-dependent sizes
    (unbacked symbols), which need a ShapeEnv, as torch.compile has."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    shape_env = ShapeEnv() if kwargs.get("exact_size") else None
    with FakeTensorMode(shape_env=shape_env, static_shapes=True) as mode:
        conv = lambda t: mode.from_tensor(t) if isinstance(t, Tensor) else t  # noqa: E731
        outs = op(*[conv(a) for a in args], **{k: conv(v) for k, v in kwargs.items()})
    outs = outs if isinstance(outs, (tuple, list)) else (outs,)
    return [(tuple(t.shape), t.dtype) for t in outs]


def check_fake(op: str, fake, real) -> None:
    """The fake's shapes and dtypes are the real ones; a data-dependent size (exact_size's row
    counts: a symbol, or 3 times it) stands for whatever the real call received."""
    real = [(tuple(t.shape), t.dtype) for t in real]

    def same(f, r):
        (fs, fd), (rs, rd) = f, r
        return fd == rd and len(fs) == len(rs) and all(
            isinstance(a, torch.SymInt) or a == b for a, b in zip(fs, rs))

    check(len(fake) == len(real) and all(same(f, r) for f, r in zip(fake, real)),
          f"{op}: fake outputs {fake} != real {real}")


def agreed(ctx, checks: Callable[[], None]) -> None:
    """Runs checks on every rank, then all ranks fail together if any did: a case that goes on
    with more op calls must not leave the ranks out of step (the others would wait for the
    failed rank until the deadline)."""
    err = None
    try:
        checks()
    except Exception as e:  # noqa: BLE001 (re-raised below)
        err = e
    failed = [r for r, bad in enumerate(ctx.comm.allgather(err is not None)) if bad]
    if err is not None:
        raise err
    if failed:
        raise CaseFailure(f"checks failed on rank(s) {failed}")


def run_experts(spec, world, rank, expand_x, etn, etn_type=1, dyn=None) -> Tensor:
    """The experts of this rank on the valid rows of expand_x (dequantising int8 rows first),
    grouped by expert_token_nums; rows past the valid ones are left as zeros."""
    counts = etn.tolist()
    if etn_type == 0:
        counts = [c - p for c, p in zip(counts, [0] + counts[:-1])]
    out = torch.zeros(expand_x.shape, dtype=spec.dtype)
    start = 0
    for block, n in enumerate(counts):
        rows = expand_x[start : start + n]
        if dyn is not None:
            rows = (rows.float() * dyn[start : start + n, None]).to(spec.dtype)
        if rank < spec.s:
            c = SHARED_COEF[rank // (spec.s // spec.ns)]
        else:
            c = coef((rank - spec.s) * len(counts) + block)
        out[start : start + n] = rows * c
        start += n
    return out


def round_trip(ctx, spec: Spec, etn_type=1, quant=False, perf=None, wrapper=True,
               comm_quant=False, exact=False):
    """dispatch_v2 -> experts -> combine_v2 on this rank's inputs of `spec`, everything checked.
    comm_quant: combine_v2 with comm_quant_mode 2, checked bitwise against SPEC §2.3 on the
    dequantised rows and within dispatch.h's bound of the unquantised sum. exact: both ops with
    exact_size=True (outputs sized to the rows received)."""
    world, rank = ctx.world, ctx.rank
    all_in = [make_inputs(spec, r) for r in range(world)]
    mine = all_in[rank]
    smooth = smooth_scales(spec) if spec.smooth else None
    kw = dict(
        expert_scales=mine.w,
        x_active_mask=mine.mask,
        shared_expert_num=spec.ns,
        shared_expert_rank_num=spec.s,
        global_bs=spec.global_bs,
        **special_kwargs(spec),
    )
    kw.update(expert_token_nums_type=etn_type, quant_mode=2 if quant else 0, scales=smooth)
    if exact:
        kw.update(exact_size=True)
    out = mt.dispatch_v2(mine.x, mine.ids, ctx.comm, moe_expert_num=spec.e, **kw)
    y = run_experts(spec, world, rank, out[0], out[3], etn_type, out[1] if quant else None)
    ckw = dict(
        x_active_mask=mine.mask, shared_expert_num=spec.ns, shared_expert_rank_num=spec.s,
        global_bs=spec.global_bs, comm_quant_mode=2 if comm_quant else 0,
        **special_kwargs(spec), **special_combine_kwargs(spec, mine),
    )
    if exact:
        ckw.update(exact_size=True)
    got = mt.combine_v2(
        y, mine.ids, out[2], out[4], mine.w, ctx.comm, moe_expert_num=spec.e, **ckw
    )
    # What torch.compile would see: the fake implementations on the same arguments.
    gid = mt.group_id(ctx.comm)
    fake_d = fake_run(
        torch.ops.moe_ep.dispatch_v2, (mine.x, mine.ids, gid, world, rank, spec.e), kw
    )
    fake_c = fake_run(
        torch.ops.moe_ep.combine_v2,
        (y, mine.ids, out[2], out[4], mine.w, gid, world, rank, spec.e), ckw,
    )

    # SPEC §7: a cached dispatch with the handle, and combine with the handle (neither
    # assist_info_for_combine nor ep_send_counts read): the same bits.
    cached = mt.dispatch_v2(mine.x, mine.ids, ctx.comm, moe_expert_num=spec.e, handle=out.handle,
                            **kw)
    y_c = run_experts(spec, world, rank, cached[0], cached[3], etn_type,
                      cached[1] if quant else None)
    got_h = mt.combine_v2(y_c, mine.ids, None, None, mine.w, ctx.comm, moe_expert_num=spec.e,
                          handle=cached.handle, **ckw)

    def checks():
        check_fake("dispatch_v2", fake_d, (*out, out.handle))
        check_fake("combine_v2", fake_c, (got,))
        check(cached.handle.shape == (1,) and cached.handle.dtype == torch.int64,
              "dispatch_v2's handle is not a (1,) int64 tensor")
        check_dispatch(spec, world, rank, all_in, cached, etn_type, quant, smooth, exact)
        check_bitwise("combine_v2 output with the handle", got_h, got)
        check_dispatch(spec, world, rank, all_in, out, etn_type, quant, smooth, exact)
        check_bitwise("combine_v2 output", got, ref_combine(spec, mine, quant, smooth, comm_quant))
        if comm_quant:
            want = ref_combine(spec, mine, quant, smooth).double()
            err = (got.double() - want).abs()
            for i, b in enumerate(comm_quant_bounds(spec, mine, quant, smooth)):
                worst = float(err[i].max()) if err.shape[1] else 0.0
                check(worst <= b, f"comm_quant_mode 2: token {i} is {worst} from the unquantised "
                      f"sum, over the bound {b}")

    agreed(ctx, checks)
    return out, got


# ---------------------------------------------------------------------------------------------
# Cases.


@dataclass
class Ctx:
    comm: object
    world: int
    rank: int


# name -> (fn, predicate on the world size)
CASES: Dict[str, Tuple[Callable[[Ctx], None], Callable[[int], bool]]] = {}


def case(min_world: int = 1, only: Optional[int] = None):
    """Registers a case for world sizes >= min_world (only: that world size alone; the costly
    cases, whose op calls do not depend on W, run once)."""

    def deco(fn):
        CASES[fn.__name__] = (fn, lambda w: w == only if only else w >= min_world)
        return fn

    return deco


def case_names(world: int) -> List[str]:
    return [n for n, (_, runs) in CASES.items() if runs(world)]


def bs_all(ctx, n):
    return (n,) * ctx.world


@case()
def round_trip_fp32(ctx):
    round_trip(ctx, Spec(1, bs_all(ctx, 5), k=2, e=2 * ctx.world, p_off=0.2))


@case()
def round_trip_bf16_running_sum(ctx):
    # expert_token_nums_type 0: running sums over local experts
    round_trip(ctx, Spec(2, bs_all(ctx, 7), k=3, e=3 * ctx.world, dtype=torch.bfloat16), 0)


@case()
def round_trip_fp16(ctx):
    round_trip(ctx, Spec(3, bs_all(ctx, 4), k=2, e=ctx.world * 2, dtype=torch.float16, p_off=0.3))


@case()
def grid_topk_tokens(ctx):
    # STYLE's grid: top-k 1, 2, 8; tokens 1, odd, larger; L = 1, 3, 8; fp32 and bf16.
    for n, (bs, k, L, dt) in enumerate(
        [
            (1, 1, 1, torch.float32),
            (9, 2, 3, torch.bfloat16),
            (3, 8, 8, torch.float32),
            (40, 8, 8, torch.bfloat16),
            (17, 1, 3, torch.float32),
        ]
    ):
        round_trip(ctx, Spec(10 + n, bs_all(ctx, bs), k=k, e=L * ctx.world, dtype=dt))


@case()
def strided_inputs(ctx):
    # SPEC §1.3: strided (non-contiguous) views are accepted; the NaN gaps between x's rows must
    # never be read
    spec = Spec(5, bs_all(ctx, 6), k=2, e=2 * ctx.world, strided=True, p_off=0.2)
    check(not make_inputs(spec, ctx.rank).x.is_contiguous(), "x is contiguous")
    round_trip(ctx, spec)
    round_trip(ctx, replace(spec, seed=6, dtype=torch.bfloat16), quant=True)


@case()
def no_tokens_anywhere(ctx):
    round_trip(ctx, Spec(20, bs_all(ctx, 0), k=2, e=2 * ctx.world))


@case()
def skewed_routing(ctx):
    # slot 0 of every token goes to expert 0: one big block, empty experts elsewhere (K = 1:
    # every expert but 0 is empty)
    round_trip(ctx, Spec(21, bs_all(ctx, 6), k=1, e=2 * ctx.world, skew=True))
    round_trip(ctx, Spec(22, bs_all(ctx, 6), k=2, e=2 * ctx.world, skew=True, dtype=torch.bfloat16))


@case()
def uneven_tokens_global_bs(ctx):
    # BS differs across ranks (one rank has none); global_bs = W * m with m >= max BS
    bs = tuple((3, 0, 5, 1)[r % 4] for r in range(ctx.world))
    round_trip(ctx, Spec(23, bs, k=2, e=2 * ctx.world, global_bs=ctx.world * 6))


@case()
def active_mask_1d(ctx):
    round_trip(ctx, Spec(24, bs_all(ctx, 8), k=2, e=2 * ctx.world, mask="1d"))
    round_trip(ctx, Spec(25, bs_all(ctx, 8), k=3, e=4 * ctx.world, mask="1d", p_off=0.25,
                         dtype=torch.bfloat16))


@case()
def active_mask_2d(ctx):
    round_trip(ctx, Spec(26, bs_all(ctx, 8), k=3, e=3 * ctx.world, mask="2d"))


@case()
def quant_mode_2(ctx):
    # int8 expand_x, fp32 dynamic_scales: SPEC §1.5 bitwise plus the dequantisation bound; the
    # experts dequantise, and combine's sum is checked bitwise against the same arithmetic
    round_trip(ctx, Spec(27, bs_all(ctx, 6), k=2, e=2 * ctx.world, dtype=torch.bfloat16),
               quant=True)
    round_trip(ctx, Spec(28, bs_all(ctx, 5), k=3, e=3 * ctx.world, p_off=0.2, smooth=True),
               quant=True)


@case(min_world=2)
def shared_expert_rank(ctx):
    # S = 1 (rank 0 hosts the shared expert, gets every active token), Ns = 1, L = 2
    w = ctx.world
    round_trip(ctx, Spec(30, bs_all(ctx, 5), k=2, e=2 * (w - 1), s=1, ns=1, p_off=0.2))
    round_trip(ctx, Spec(31, bs_all(ctx, 4), k=2, e=2 * (w - 1), s=1, ns=1, mask="2d",
                         dtype=torch.bfloat16), quant=True)
    round_trip(ctx, Spec(33, bs_all(ctx, 4), k=2, e=2 * (w - 1), s=1, ns=1, smooth=True),
               quant=True)


@case(min_world=3)
def two_shared_expert_ranks(ctx):
    # S = 2, Ns = 2: rank 0 hosts shared expert 0, rank 1 shared expert 1 (every token goes to
    # both); S = 2, Ns = 1: shared expert 0 on ranks 0 and 1, even ranks send to 0, odd to 1
    w = ctx.world
    round_trip(ctx, Spec(32, bs_all(ctx, 5), k=1, e=w - 2, s=2, ns=2))
    round_trip(ctx, Spec(34, bs_all(ctx, 3), k=2, e=2 * (w - 2), s=2, ns=1, p_off=0.2))


@case()
def comm_quant_mode_2(ctx):
    """combine_v2 with comm_quant_mode 2 (SPEC §2.1, §2.3): the expert output rows travel back as
    int8 with an fp32 scale. Bitwise against SPEC §2.3 on the rows quantised as §1.5 says and
    dequantised as fl(q * scale), and within dispatch.h's bound of the unquantised sum."""
    w = ctx.world
    round_trip(ctx, Spec(100, bs_all(ctx, 5), k=2, e=2 * w, dtype=torch.bfloat16, p_off=0.2),
               comm_quant=True)
    round_trip(ctx, Spec(101, bs_all(ctx, 4), k=3, e=3 * w, mask="2d"), comm_quant=True)
    # int8 both ways: quant_mode 2 in dispatch_v2 (smoothed), comm_quant_mode 2 in combine_v2
    round_trip(ctx, Spec(102, bs_all(ctx, 4), k=2, e=2 * w, dtype=torch.float16, smooth=True),
               quant=True, comm_quant=True)
    if w >= 2:  # the shared expert's rows travel quantised too
        round_trip(ctx, Spec(103, bs_all(ctx, 4), k=2, e=2 * (w - 1), s=1, ns=1), comm_quant=True)


def check_special_coverage(spec: Spec, world: int, all_special_token=False) -> None:
    """The inputs of `spec` over all ranks hold active entries of every kind of special expert
    the spec has, and (all_special_token) a token whose active entries are all special (nothing
    to receive from a MoE expert, yet active): otherwise a case would not test what it says."""
    kinds, all_special = set(), False
    bounds = [(spec.e, "moe"), (spec.e + spec.z, "zero"), (spec.e + spec.z + spec.c, "copy"),
              (spec.n_ids, "const")]
    for r in range(world):
        inp = make_inputs(spec, r)
        for i in range(inp.ids.shape[0]):
            seen = [next(n for b, n in bounds if int(inp.ids[i, k]) < b)
                    for k in range(spec.k) if inp.entry_active(i, k)]
            kinds.update(seen)
            all_special |= bool(seen) and "moe" not in seen
    want = {n for n, num in (("zero", spec.z), ("copy", spec.c), ("const", spec.q)) if num}
    check(want <= kinds, f"inputs of seed {spec.seed} lack special experts {want - kinds}")
    check(all_special or not all_special_token,
          f"inputs of seed {spec.seed}: no token with only special entries")


@case()
def special_experts(ctx):
    """zero / copy / const experts (SPEC §2.2) through dispatch_v2 (never sent: the layout checks
    see only MoE rows) and combine_v2 (zero: nothing; copy: w * ori_x[i]; const q: w *
    (fl(alpha_1[q] * ori_x[i]) + fl(alpha_2[q] * v[q])), in slot order among the MoE terms),
    bitwise. ori_x holds values of its own (not x's)."""
    w = ctx.world
    specs = [
        Spec(110, bs_all(ctx, 6), k=3, e=2 * w, z=1, c=1, q=2, dtype=torch.bfloat16, p_off=0.15),
        # more special ids than MoE ones: tokens with no MoE entry at all; a 2-D mask
        Spec(111, bs_all(ctx, 6), k=4, e=w, z=2, c=2, q=3, mask="2d"),
    ]
    for n, spec in enumerate(specs):
        check_special_coverage(spec, w, all_special_token=n == 1)
        round_trip(ctx, spec)
    # strided ori_x (and x), fp16, comm_quant_mode 2: only the MoE rows travel quantised, the
    # special terms are evaluated on the token's own rank as they are
    spec = Spec(112, bs_all(ctx, 5), k=3, e=2 * w, z=1, c=2, q=1, dtype=torch.float16,
                strided=True)
    check_special_coverage(spec, w)
    check(not make_inputs(spec, ctx.rank).ori_x.is_contiguous(), "ori_x is contiguous")
    round_trip(ctx, spec, comm_quant=True)
    if w >= 2:  # a shared-expert rank: a token whose entries are all special still goes to it
        spec = Spec(113, bs_all(ctx, 5), k=2, e=w - 1, z=1, c=1, q=1, s=1, ns=1)
        check_special_coverage(spec, w, all_special_token=True)
        round_trip(ctx, spec)


@case()
def exact_size_matches_default(ctx):
    """exact_size=True (EpConfig::exact_size): the row outputs hold the rows received (expand_x
    (n, H), dynamic_scales and expand_scales (n,), assist_info_for_combine (3n,)), each checked
    against the reference like the default's; the valid rows and every other output bitwise the
    default mode's, and combine_v2's output too (with and without the handle, inside
    round_trip); the fake gives data-dependent row counts. Masks, int8 (smoothed), comm_quant,
    uneven BS, shared-expert ranks and special experts."""
    w = ctx.world
    runs = [
        (Spec(120, bs_all(ctx, 6), k=3, e=3 * w, p_off=0.2, mask="2d"), {}),
        (Spec(121, bs_all(ctx, 5), k=2, e=2 * w, dtype=torch.bfloat16, mask="1d"),
         dict(quant=True)),
        (Spec(122, bs_all(ctx, 4), k=3, e=3 * w, smooth=True), dict(quant=True, comm_quant=True)),
        (Spec(123, tuple((3, 0, 5, 1)[r % 4] for r in range(w)), k=2, e=2 * w,
              global_bs=w * 6), {}),
        (Spec(124, bs_all(ctx, 5), k=3, e=2 * w, z=1, c=1, q=1, dtype=torch.float16), {}),
    ]
    if w >= 2:
        runs.append((Spec(125, bs_all(ctx, 4), k=2, e=2 * (w - 1), s=1, ns=1, mask="2d"), {}))
    for spec, kw in runs:
        want_d, want_c = round_trip(ctx, spec, **kw)
        got_d, got_c = round_trip(ctx, spec, exact=True, **kw)
        valid = int(want_d[4][-1]) if want_d[4].numel() else 0

        def checks():
            check(tuple(got_d[0].shape) == (valid, spec.h), f"exact expand_x {got_d[0].shape}")
            (g, _), (d, _) = dispatch_prefixes(got_d), dispatch_prefixes(want_d)
            for name, a, b in zip(("expand_x", "dynamic_scales", "assist_info_for_combine",
                                   "expert_token_nums", "ep_recv_counts", "tp_recv_counts",
                                   "expand_scales"), g, d):
                n = valid if name in ("dynamic_scales", "expand_scales") and b.numel() else None
                check_bitwise(f"seed {spec.seed}: exact_size {name} vs the default's",
                              a[:n] if n is not None else a, b[:n] if n is not None else b)
            check_bitwise(f"seed {spec.seed}: exact_size combine_v2 vs the default's", got_c,
                          want_c)

        agreed(ctx, checks)


@case(min_world=2)
def exact_size_errors(ctx):
    """exact_size must be the same on every rank: InvalidArgumentError naming it on every rank
    (dispatch_v2 and combine_v2); a combine_v2 without exact_size given exact-size
    assist_info_for_combine: InvalidArgumentError naming exact_size. Then the communicator works."""
    spec = Spec(126, bs_all(ctx, 3), k=2, e=2 * ctx.world)
    mine = make_inputs(spec, ctx.rank)
    mixed = ctx.rank == 1
    errors = []

    def expect_error(call):
        try:
            call()
        except moe_ep.Error as err:  # any kind: checked below, so the ranks stay in step
            errors.append(err)

    expect_error(lambda: mt.dispatch_v2(mine.x, mine.ids, ctx.comm, moe_expert_num=spec.e,
                                        exact_size=mixed))
    d = mt.dispatch_v2(mine.x, mine.ids, ctx.comm, moe_expert_num=spec.e, exact_size=True)
    # With the handle (assist_info_for_combine not read) every rank's own checks pass and the
    # header agreement finds the values differ; without it and with exact_size False, every
    # rank's assist_info_for_combine has the wrong size.
    for exact, handle in ((mixed, d.handle), (False, None)):
        expect_error(lambda: mt.combine_v2(
            d.expand_x, mine.ids, d.assist_info_for_combine, d.ep_recv_counts, mine.w, ctx.comm,
            moe_expert_num=spec.e, exact_size=exact, handle=handle))

    def checks():
        msgs = [str(e) for e in errors]
        check(len(errors) == 3, f"{len(errors)} errors raised of 3: {msgs}")
        check(all(type(e) is moe_ep.InvalidArgumentError for e in errors), f"{errors!r}")
        for op, msg in zip(("dispatch_v2", "combine_v2"), msgs):
            check(f"{op}: exact_size differs across ranks" in msg, msg)
        check("pass exact_size = true to combine_v2 as well" in msgs[-1], msgs[-1])

    agreed(ctx, checks)
    round_trip(ctx, spec, exact=True)  # still in step


@case(only=2)
def compile_fullgraph_exact_size(ctx):
    """torch.compile(fullgraph=True) of a layer calling dispatch_v2 / combine_v2 with
    exact_size=True: the row count is a data-dependent (unbacked) size while tracing; the outputs
    equal eager's (and their shapes the rows received)."""
    spec, mine, gid = _opcheck_args(ctx)
    comm, e = ctx.comm, spec.e

    def layer(x, ids, weights):
        outs = mt.dispatch_v2(x, ids, comm, moe_expert_num=e, expert_scales=weights,
                              exact_size=True)
        y = outs[0] * 2.0
        out = mt.combine_v2(y, ids, outs[2], outs[4], weights, comm, moe_expert_num=e,
                            exact_size=True)
        return (out, *outs)

    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    got, want = compiled(mine.x, mine.ids, mine.w), layer(mine.x, mine.ids, mine.w)

    def checks():
        valid = int(want[5][-1]) if want[5].numel() else 0
        check(tuple(want[1].shape) == (valid, spec.h), f"expand_x {tuple(want[1].shape)}")
        for n, (g, ref) in enumerate(zip(got, want)):
            check_bitwise(f"compiled output {n}", g, ref)

    agreed(ctx, checks)


def scale_in_table(world: int, removed: int, new_s: int, new_e: int) -> Tensor:
    """SPEC §1.7's elastic_info: rank `removed` leaves, the others keep their order."""
    old_to_new, new_to_old = [], []
    for o in range(world):
        old_to_new.append(-1 if o == removed else len(new_to_old))
        if o != removed:
            new_to_old.append(o)
    new_to_old += [-1] * (world - len(new_to_old))
    return torch.tensor([1, world - 1, new_s, new_e] + old_to_new + new_to_old, dtype=torch.int32)


def scale_in_round_trip(ctx, spec: Spec, removed: int, quant=False) -> None:
    """dispatch_v2 -> experts -> combine_v2 with elastic_info removing rank `removed` (SPEC §1.7,
    dispatch.h "Scale-in"). spec is the smaller world's (W - 1 ranks, its S and E, which the table
    carries; moe_expert_num and shared_expert_rank_num stay the old world's: 2 W, 0, so the new
    E differs from the old and placement must use the table's): each survivor's outputs must be
    those of a fresh run of that world at its new rank, checked against the oracle of that
    world; the removed rank gets empty outputs, tp_recv_counts [0] and combine zeros (BS, H)."""
    world, rank, small = ctx.world, ctx.rank, ctx.world - 1
    assert len(spec.bs) == small
    table = scale_in_table(world, removed, spec.s, spec.e)
    old_e = 2 * world
    nr = int(table[4 + rank])
    all_in = [make_inputs(spec, r) for r in range(small)]
    # the removed rank passes tokens of its own (as many as the others, valid for the new E);
    # they go nowhere
    mine = all_in[nr] if nr >= 0 else make_inputs(replace(spec, seed=spec.seed + 1), 0)
    smooth = smooth_scales(spec) if spec.smooth else None
    common = dict(x_active_mask=mine.mask, shared_expert_num=spec.ns, shared_expert_rank_num=0,
                  global_bs=spec.global_bs, elastic_info=table)
    kw = dict(common, expert_scales=mine.w, quant_mode=2 if quant else 0, scales=smooth)
    out = mt.dispatch_v2(mine.x, mine.ids, ctx.comm, moe_expert_num=old_e, **kw)
    if nr >= 0:
        y = run_experts(spec, small, nr, out[0], out[3], dyn=out[1] if quant else None)
    else:
        y = out[0] if not quant else torch.zeros(out[0].shape, dtype=spec.dtype)
    got = mt.combine_v2(y, mine.ids, out[2], out[4], mine.w, ctx.comm, moe_expert_num=old_e,
                        **common)
    gid = mt.group_id(ctx.comm)
    try:  # the dispatch fake cannot know the shapes: it refuses (eager only)
        fake_run(torch.ops.moe_ep.dispatch_v2, (mine.x, mine.ids, gid, world, rank, old_e), kw)
        fake_err = None
    except moe_ep.Error as err:
        fake_err = err
    fake_c = fake_run(torch.ops.moe_ep.combine_v2,
                      (y, mine.ids, out[2], out[4], mine.w, gid, world, rank, old_e), common)

    def checks():
        check(isinstance(fake_err, moe_ep.UnsupportedError)
              and "elastic_info cannot be traced" in str(fake_err),
              f"dispatch_v2's fake with elastic_info: {fake_err!r}")
        check_fake("combine_v2", fake_c, (got,))
        if nr >= 0:
            check_dispatch(spec, small, nr, all_in, out, quant=quant, smooth=smooth)
            check_bitwise("combine_v2 output", got, ref_combine(spec, mine, quant, smooth))
            return
        expand_x, dyn, assist, etn, recv, tp_recv, exp_scales = out
        check(tuple(expand_x.shape) == (0, spec.h), f"removed rank: expand_x {expand_x.shape}")
        for name, t in (("dynamic_scales", dyn), ("assist_info_for_combine", assist),
                        ("expert_token_nums", etn), ("ep_recv_counts", recv),
                        ("expand_scales", exp_scales)):
            check(t.numel() == 0, f"removed rank: {name} {tuple(t.shape)} is not empty")
        check_bitwise("removed rank: tp_recv_counts", tp_recv, torch.zeros(1, dtype=torch.int32))
        check_bitwise("removed rank: combine_v2 output", got,
                      torch.zeros(tuple(mine.x.shape), dtype=spec.dtype))

    agreed(ctx, checks)


@case(min_world=2)
def elastic_scale_in(ctx):
    """elastic_info scale-in (SPEC §1.7): one rank removed (a middle one, the first, the last);
    the survivors renumbered get a fresh run of the smaller world, bitwise; the removed rank
    empty outputs. Eager only (dispatch_v2's fake refuses elastic_info)."""
    w = ctx.world
    small = lambda n: (n,) * (w - 1)  # noqa: E731
    scale_in_round_trip(ctx, Spec(120, small(5), k=2, e=2 * (w - 1), p_off=0.2), removed=1)
    scale_in_round_trip(ctx, Spec(121, small(4), k=3, e=3 * (w - 1), mask="2d",
                                  dtype=torch.bfloat16), removed=0, quant=True)
    if w >= 3:  # the new world has a shared-expert rank (new S = 1), the old one none
        scale_in_round_trip(ctx, Spec(122, small(4), k=2, e=2 * (w - 2), s=1, ns=1),
                            removed=w - 1)


def tp_partial(tp_rank: int, e: int, rows: Tensor) -> Tensor:
    """TP rank t's partial output of MoE expert e (x's dtype): coef(e) * x on TP rank 0,
    (0.375 - 0.125 e) * x on TP rank 1 (both round in bf16)."""
    return rows * (coef(e) if tp_rank == 0 else 0.375 - 0.125 * e)


def tp_round_trip(ctx, grouping: str, seed: int, bs: Tuple[int, int], global_bs_m: int, k: int,
                  p_off: float = 0.0) -> None:
    """tp_world_size 2 at 4 ranks (dispatch.h "Tensor parallelism"): two EP groups of 2 ranks
    (L = 1, E = 2), TP pairs of the same EP rank; grouping "seed": EP rank r // 2, TP rank
    r % 2; "halves": EP rank r % 2, TP rank r // 2. EP group t (the ranks of TP rank t) has its
    own batch (bs[t] tokens per rank). dispatch_v2: this rank's EP rows, then the TP peer's,
    packed; combine_v2 with each TP rank's partial expert outputs: every token gets
    bf16(fp32(partial 0) + fp32(partial 1)) as its expert row."""
    r, w = ctx.rank, 2
    ep_rank, tp_rank = (r // 2, r % 2) if grouping == "seed" else (r % 2, r // 2)
    ep = ctx.comm.Split(tp_rank, ep_rank)
    tp = ctx.comm.Split(ep_rank, tp_rank)
    gid_ep, gid_tp = mt.group_id(ep), mt.group_id(tp)  # both collective: the same order everywhere
    gbs = w * global_bs_m
    specs = [Spec(seed + t, (bs[t],) * w, k=k, e=w, dtype=torch.bfloat16, h=16, p_off=p_off,
                  global_bs=gbs) for t in (0, 1)]
    spec, peer_spec = specs[tp_rank], specs[1 - tp_rank]
    all_in = [[make_inputs(specs[t], p) for p in range(w)] for t in (0, 1)]
    mine = all_in[tp_rank][ep_rank]
    tpkw = dict(tp_world_size=2, tp_rank_id=tp_rank, global_bs=gbs)
    out = mt.dispatch_v2(mine.x, mine.ids, ep, moe_expert_num=w, group_tp=tp,
                         expert_scales=mine.w, **tpkw)
    expand_x, dyn, assist, etn, recv, tp_recv, exp_scales = out
    own_rows = expected_rows(spec, w, ep_rank, all_in[tp_rank])
    peer_rows = expected_rows(peer_spec, w, ep_rank, all_in[1 - tp_rank])
    own, peer = len(own_rows), len(peer_rows)
    valid = own + peer
    # this TP rank's partial on every valid row, its own EP group's and the peer's alike
    y = torch.zeros(expand_x.shape, dtype=spec.dtype)
    y[:valid] = tp_partial(tp_rank, ep_rank, expand_x[:valid])
    got = mt.combine_v2(y, mine.ids, assist, recv, mine.w, ep, moe_expert_num=w, group_tp=tp,
                        tp_send_counts=tp_recv, **tpkw)
    fake_d = fake_run(torch.ops.moe_ep.dispatch_v2, (mine.x, mine.ids, gid_ep, w, ep_rank, w),
                      dict(tpkw, group_tp=gid_tp, expert_scales=mine.w))
    fake_c = fake_run(torch.ops.moe_ep.combine_v2,
                      (y, mine.ids, assist, recv, mine.w, gid_ep, w, ep_rank, w),
                      dict(tpkw, group_tp=gid_tp, tp_send_counts=tp_recv))

    # SPEC §7 with TP: combine with the handle (no assist_info_for_combine, ep_send_counts or
    # tp_send_counts read): the same bits.
    got_h = mt.combine_v2(y, mine.ids, None, None, mine.w, ep, moe_expert_num=w, group_tp=tp,
                          handle=out.handle, **tpkw)

    def checks():
        check_fake("dispatch_v2", fake_d, (*out, out.handle))
        check_fake("combine_v2", fake_c, (got,))
        check_bitwise("combine_v2 output with the handle", got_h, got)
        a = capacity(spec, w, ep_rank)
        check(a == capacity(peer_spec, w, ep_rank), "the TP pair's A differ")
        h = spec.h
        check(tuple(expand_x.shape) == (2 * a, h) and expand_x.dtype == spec.dtype,
              f"expand_x {tuple(expand_x.shape)} {expand_x.dtype}, want (2A={2 * a}, {h})")
        check(tuple(dyn.shape) == (0,), f"dynamic_scales {tuple(dyn.shape)}")
        bsk = mine.ids.shape[0] * spec.k
        check(tuple(assist.shape) == (max(bsk, a * 128),) and assist.dtype == torch.int32,
              f"assist_info_for_combine {tuple(assist.shape)}")
        check(tuple(exp_scales.shape) == (2 * a,), f"expand_scales {tuple(exp_scales.shape)}")
        want_tp = torch.zeros(2, dtype=torch.int32)
        want_tp[tp_rank], want_tp[1 - tp_rank] = own, peer
        check_bitwise("tp_recv_counts", tp_recv, want_tp)
        check_bitwise("expert_token_nums", etn, torch.tensor([valid], dtype=torch.int64))

        def blocks(rows):  # per source rank, L = 1
            n = torch.zeros(w, dtype=torch.int64)
            for row in rows:
                n[row.src] += 1
            return n

        want_recv = torch.cat([blocks(own_rows), blocks(peer_rows)]).cumsum(0).to(torch.int32)
        check_bitwise("ep_recv_counts (own blocks, then the peer's)", recv, want_recv)
        src = [(all_in[tp_rank], row) for row in own_rows]
        src += [(all_in[1 - tp_rank], row) for row in peer_rows]
        want_meta = torch.tensor([[row.src, row.token, row.slot] for _, row in src],
                                 dtype=torch.int32).view(valid, 3)
        check_bitwise("assist_info_for_combine (own rows, then the peer's)",
                      assist[: 3 * valid].view(valid, 3), want_meta)
        if valid:
            check_bitwise("expand_x rows (own, then the peer's)", expand_x[:valid],
                          torch.stack([g[row.src].x[row.token] for g, row in src]))
            check_bitwise("expand_scales", exp_scales[:valid],
                          torch.stack([g[row.src].w[row.token, row.slot] for g, row in src]))

        def tp_sum(row, x_row):  # SPEC §2: partials summed in fp32, TP-rank order, rounded once
            parts = [tp_partial(t, row.expert, x_row).float() for t in (0, 1)]
            return (parts[0] + parts[1]).to(spec.dtype)

        check_bitwise("combine_v2 output", got, ref_combine(spec, mine, expert=tp_sum))

    try:
        agreed(ctx, checks)
    finally:
        for c in (ep, tp):
            mt.release_group(c)
            c.Free()


@case(only=4)
def tensor_parallel_pairs(ctx):
    """tp_world_size 2 with group_tp (an mpi4py Split communicator): two EP groups of 2, each
    rank's TP peer the same EP rank of the other group, in both rank groupings."""
    # EP groups of different BS (5 and 3 tokens, global_bs = W * 5 on both: the same A)
    tp_round_trip(ctx, "seed", 130, (5, 3), 5, k=1)
    # top-2 of 2 experts with inactive entries
    tp_round_trip(ctx, "halves", 132, (4, 4), 4, k=2, p_off=0.25)


# ---------------------------------------------------------------------------------------------
# The size query (dispatch_workspace) and the window option (group_id's shm_window_bytes).


def nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def shm_transport() -> bool:
    """Whether the ops use the shared-memory transport (the default; $MOE_EP_TRANSPORT=mpi: not),
    which is what shm_slot_bytes and shm_stage_bytes size (dispatch.h)."""
    import os

    return os.environ.get("MOE_EP_TRANSPORT", "") in ("", "shm")


def window_slot(nbytes_: int) -> int:
    """A window slot holding nbytes_ (dispatch.h: rounded up to 4 KiB; the window hands out at
    least one 4 KiB granule, even for 0 bytes)."""
    return -(-max(nbytes_, 1) // 4096) * 4096


def check_workspace(what: str, ws, a: int, rows: int, h: int, bs: int, dtype, quant: bool,
                    comm_quant: bool, out, got, shm: bool) -> None:
    """ws (dispatch_workspace) against the real outputs of the dispatch_v2 and combine_v2 that
    followed it, and against SPEC §1.4's A: expand_x (rows = max(1,T) * A, H), the other six
    dispatch outputs (dynamic_scales is (0,) without quant_mode 2), combine's x (BS, H)."""
    esize = torch.empty((), dtype=dtype).element_size()
    check(type(ws) is mt.DispatchWorkspace and all(type(v) is int for v in ws),
          f"{what}: {ws!r} is not a DispatchWorkspace of ints")
    check(ws.recv_rows == a, f"{what}: recv_rows {ws.recv_rows} != A = {a}")
    check(out.expand_x.shape[0] == rows, f"{what}: expand_x has {out.expand_x.shape[0]} rows, "
          f"not {rows}")
    check(ws.expand_x_bytes == nbytes(out.expand_x) == rows * h * (1 if quant else esize),
          f"{what}: expand_x_bytes {ws.expand_x_bytes}, expand_x {tuple(out.expand_x.shape)} "
          f"{out.expand_x.dtype} holds {nbytes(out.expand_x)}")
    others = {name: nbytes(t) for name, t in zip(out._fields[1:], out[1:])}
    check(ws.other_outputs_bytes == sum(others.values()),
          f"{what}: other_outputs_bytes {ws.other_outputs_bytes} != {sum(others.values())} "
          f"({others})")
    check(ws.combine_output_bytes == nbytes(got) == bs * h * esize,
          f"{what}: combine_output_bytes {ws.combine_output_bytes}, combine_v2's x "
          f"{tuple(got.shape)} {got.dtype} holds {nbytes(got)}")
    # expand_x, then from a 64-byte boundary 16 bytes of metadata per row (dispatch.h).
    want_slot = window_slot(-(-ws.expand_x_bytes // 64) * 64 + rows * 16) if shm else 0
    # comm_quant_mode 2: the int8 rows, then from a 64-byte boundary their fp32 scales
    stage = -(-a * h // 64) * 64 + a * 4 if comm_quant else a * h * esize
    want_stage = window_slot(stage) if shm else 0
    check((ws.shm_slot_bytes, ws.shm_stage_bytes) == (want_slot, want_stage),
          f"{what}: (shm_slot_bytes, shm_stage_bytes) = ({ws.shm_slot_bytes}, "
          f"{ws.shm_stage_bytes}), want ({want_slot}, {want_stage})")


def workspace_of(ctx, spec: Spec, quant=False, comm_quant=False, group_ep=None):
    """dispatch_workspace with the arguments round_trip gives dispatch_v2 and combine_v2; an
    error is returned, not raised (the query is local: the ranks stay in step either way)."""
    try:
        return mt.dispatch_workspace(
            spec.bs[ctx.rank], spec.h, spec.k, spec.dtype,
            ctx.comm if group_ep is None else group_ep, moe_expert_num=spec.e,
            shared_expert_num=spec.ns, shared_expert_rank_num=spec.s, global_bs=spec.global_bs,
            quant_mode=2 if quant else 0, comm_quant_mode=2 if comm_quant else 0,
            **special_kwargs(spec),
        )
    except Exception as err:  # noqa: BLE001 (reported by the checks)
        return err


@case()
def workspace_matches_outputs(ctx):
    """moe_ep.torch.dispatch_workspace (dispatch.h, DispatchWorkspace) equals what the
    dispatch_v2 and combine_v2 that follow it return, byte for byte, across dtypes, quant_mode 0
    and 2, comm_quant_mode 0 and 2, shared-expert ranks, special experts, no tokens and uneven
    BS with global_bs; with tp_world_size 2 (group_tp) at 4 ranks. The query is local: one rank
    alone calls it. Bad arguments raise the C++ messages (docs/errors.md, tests/mpi/
    test_workspace.cc)."""
    w, rank = ctx.world, ctx.rank
    shm = shm_transport()
    configs = [  # (spec, quant_mode 2, comm_quant_mode 2)
        (Spec(150, bs_all(ctx, 5), k=2, e=2 * w, p_off=0.2), False, False),
        (Spec(151, bs_all(ctx, 7), k=3, e=3 * w, dtype=torch.bfloat16), True, False),
        # rows of more than one 4 KiB granule, so that the window sizes tell 1 byte per element
        # (int8) from x's element size
        (Spec(152, bs_all(ctx, 4), k=2, e=2 * w, dtype=torch.bfloat16, h=520), False, True),
        (Spec(153, bs_all(ctx, 6), k=3, e=3 * w, h=200, smooth=True), True, True),
        (Spec(154, bs_all(ctx, 0), k=2, e=2 * w), False, False),  # A = 0
        (Spec(155, tuple((3, 0, 5, 1)[r % 4] for r in range(w)), k=2, e=2 * w,
              dtype=torch.bfloat16, global_bs=6 * w), False, False),
        (Spec(156, bs_all(ctx, 5), k=3, e=2 * w, z=1, c=1, q=1), False, False),
    ]
    if w >= 2:  # S = 1: rank 0's A is (G / W) * ceil(W / (S / Ns))
        configs += [
            (Spec(157, bs_all(ctx, 5), k=2, e=2 * (w - 1), s=1, dtype=torch.bfloat16), True,
             False),
            (Spec(158, bs_all(ctx, 4), k=2, e=2 * (w - 1), s=1), False, True),
        ]
    if w >= 3:
        configs.append((Spec(159, bs_all(ctx, 5), k=1, e=w - 2, s=2, ns=2), False, False))
    for spec, quant, comm_quant in configs:
        ws = workspace_of(ctx, spec, quant, comm_quant)
        out, got = round_trip(ctx, spec, quant=quant, comm_quant=comm_quant)

        def checks():
            what = f"seed {spec.seed}"
            if isinstance(ws, Exception):
                raise CaseFailure(f"{what}: dispatch_workspace raised {ws!r}")
            check_workspace(what, ws, capacity(spec, w, rank), capacity(spec, w, rank), spec.h,
                            spec.bs[rank], spec.dtype, quant, comm_quant, out, got, shm)

        agreed(ctx, checks)

    # Local: the last rank alone queries, by group id as well. Were it collective, that rank
    # would wait in it for the others, which go straight on to the agreement below.
    spec = configs[0][0]
    alone = []
    if rank == w - 1:
        alone = [workspace_of(ctx, spec, group_ep=g) for g in (ctx.comm, mt.group_id(ctx.comm))]
    want = workspace_of(ctx, spec)

    def local_checks():
        for got in alone:
            check(got == want, f"queried alone: {got!r} != {want!r}")

    agreed(ctx, local_checks)

    # Bad arguments: on every rank alike (local checks), exact messages.
    e = 2 * w
    bad_rank = (rank + 1) % (w + 1)  # never this rank
    bad = [
        (dict(hidden=0), moe_ep.InvalidArgumentError,
         "dispatch_workspace: hidden = 0 must be in [1, 2147483647] (x.shape[1])"),
        (dict(bs=-1), moe_ep.InvalidArgumentError,
         "dispatch_workspace: bs = -1 must be in [0, 2147483647] (x.shape[0])"),
        (dict(top_k=e + 1), moe_ep.InvalidArgumentError,
         f"dispatch_workspace: top_k = {e + 1} must be in [1, {e}] (moe_expert_num + "
         "zero/copy/const experts)"),
        (dict(dtype=torch.int32), moe_ep.InvalidArgumentError,
         "dispatch_workspace: dtype = int32 must be bf16, fp16 or fp32"),
        (dict(quant_mode=1), moe_ep.InvalidArgumentError,
         "dispatch_workspace: quant_mode = 1 is not one of {0, 2}"),
        (dict(quant_mode=2, comm_quant_mode=1), moe_ep.InvalidArgumentError,
         "dispatch_workspace: comm_quant_mode = 1 is not one of {0, 2}"),
        (dict(dtype=torch.float64), moe_ep.UnsupportedError,
         "dispatch_workspace: dtype = torch.float64 is not one of torch.bfloat16, torch.float16, "
         "torch.float32"),
        (dict(ep_rank_id=bad_rank), moe_ep.InvalidArgumentError, f"ep_rank_id = {bad_rank}"),
    ]
    raised = []
    for change, cls, message in bad:
        args = dict(bs=4, hidden=8, top_k=2, dtype=torch.bfloat16, group_ep=ctx.comm,
                    moe_expert_num=e)
        args.update(change)
        try:
            mt.dispatch_workspace(**args)
            raised.append((change, cls, message, None))
        except moe_ep.Error as err:
            raised.append((change, cls, message, err))

    def error_checks():
        for change, cls, message, err in raised:
            check(type(err) is cls, f"{change}: raised {err!r}, want {cls.__name__}")
            exact = not message.startswith("ep_rank_id")
            check(str(err) == message if exact else message in str(err),
                  f"{change}: message {str(err)!r}, want {message!r}")

    agreed(ctx, error_checks)

    if w == 4:  # tp_world_size 2: EP groups {0, 1}, {2, 3}; TP pairs {0, 2}, {1, 3}
        ep_rank, tp_rank = rank % 2, rank // 2
        ep, tp = ctx.comm.Split(tp_rank, ep_rank), ctx.comm.Split(ep_rank, tp_rank)
        try:
            mt.group_id(ep), mt.group_id(tp)  # collective: the same order everywhere
            spec = Spec(141, (4, 4), k=1, e=2, dtype=torch.bfloat16, h=16)
            mine = make_inputs(spec, ep_rank)
            tpkw = dict(group_tp=tp, tp_world_size=2, tp_rank_id=tp_rank)
            try:
                ws = mt.dispatch_workspace(4, spec.h, 1, spec.dtype, ep, moe_expert_num=2, **tpkw)
            except Exception as err:  # noqa: BLE001 (reported by the checks)
                ws = err
            out = mt.dispatch_v2(mine.x, mine.ids, ep, moe_expert_num=2, expert_scales=mine.w,
                                 **tpkw)
            got = mt.combine_v2(out.expand_x, mine.ids, out.assist_info_for_combine,
                                out.ep_recv_counts, mine.w, ep, moe_expert_num=2,
                                tp_send_counts=out.tp_recv_counts, **tpkw)

            def tp_checks():
                if isinstance(ws, Exception):
                    raise CaseFailure(f"tp_world_size 2: dispatch_workspace raised {ws!r}")
                a = capacity(spec, 2, ep_rank)
                # expand_x holds both TP ranks' rows (2A); every call uses MPI (no window)
                check_workspace("tp_world_size 2", ws, a, 2 * a, spec.h, 4, spec.dtype, False,
                                False, out, got, shm=False)

            agreed(ctx, tp_checks)
        finally:
            for c in (ep, tp):
                mt.release_group(c)
                c.Free()


@case()
def transport_keyword(ctx):
    """transport= (EpConfig::transport, default "": $MOE_EP_TRANSPORT, else "shm"), whatever
    $MOE_EP_TRANSPORT says: "mpi" and "shm" both match SPEC §1.4 / §2.3 and each other bit for
    bit; dispatch_workspace takes it too (no window slot with "mpi"); a bad value, and values
    that differ across ranks, are rejected by name."""
    w, rank = ctx.world, ctx.rank
    spec = Spec(80, bs_all(ctx, 5), k=2, e=2 * w, dtype=torch.bfloat16, h=40)
    all_in = [make_inputs(spec, r) for r in range(w)]
    mine = all_in[rank]
    got = {}
    for tr in ("mpi", "shm"):
        out = mt.dispatch_v2(mine.x, mine.ids, ctx.comm, moe_expert_num=spec.e,
                             expert_scales=mine.w, transport=tr)
        y = run_experts(spec, w, rank, out[0], out[3])
        comb = mt.combine_v2(y, mine.ids, out[2], out[4], mine.w, ctx.comm,
                             moe_expert_num=spec.e, transport=tr)
        valid = int(out[4][-1]) if out[4].numel() else 0
        got[tr] = (out, out[0][:valid].clone(), out[2][: 3 * valid].clone(), comb.clone())

    def same():
        for tr in ("mpi", "shm"):
            check_dispatch(spec, w, rank, all_in, got[tr][0])
            check_bitwise(f"combine_v2 output (transport {tr})", got[tr][3],
                          ref_combine(spec, mine))
        for i, what in ((1, "expand_x"), (2, "assist_info_for_combine"), (3, "combine_v2")):
            check_bitwise(f"{what}: transport shm vs mpi", got["shm"][i], got["mpi"][i])

    agreed(ctx, same)
    ws = {tr: mt.dispatch_workspace(5, spec.h, spec.k, spec.dtype, ctx.comm,
                                    moe_expert_num=spec.e, transport=tr) for tr in ("mpi", "shm")}
    agreed(ctx, lambda: check(ws["mpi"].shm_slot_bytes == 0 and ws["shm"].shm_slot_bytes > 0,
                              f"dispatch_workspace shm_slot_bytes: mpi {ws['mpi'].shm_slot_bytes}, "
                              f"shm {ws['shm'].shm_slot_bytes}"))

    def error_of(fn):
        try:
            fn()
        except moe_ep.Error as err:
            return err
        return None

    bad = error_of(lambda: mt.dispatch_v2(mine.x, mine.ids, ctx.comm, moe_expert_num=spec.e,
                                          transport="tcp"))
    agreed(ctx, lambda: check(
        isinstance(bad, moe_ep.InvalidArgumentError)
        and 'dispatch_v2: transport = "tcp" is not one of "", "mpi", "shm"' in str(bad),
        f"transport='tcp': {bad!r}"))
    if w > 1:
        mixed = error_of(lambda: mt.dispatch_v2(mine.x, mine.ids, ctx.comm,
                                                moe_expert_num=spec.e,
                                                transport="mpi" if rank == 0 else "shm"))
        agreed(ctx, lambda: check(
            isinstance(mixed, moe_ep.InvalidArgumentError)
            and "transport differs across ranks" in str(mixed),
            f"transport mpi on rank 0, shm elsewhere: {mixed!r}"))
    round_trip(ctx, Spec(81, bs_all(ctx, 3), k=2, e=2 * w))  # the communicator still works


@case()
def out_buffers(ctx):
    """dispatch_v2(..., out=...) and combine_v2(..., out=...) (DispatchBuffers, CombineInputs::out):
    the results are the caller's tensors (exact_size: their first rows), holding the bits of the
    same call without out=; an earlier result given as out (its expand_x a window slot) works as
    well, and so do quant_mode 2 (dynamic_scales written too), a cached dispatch (handle) and
    performance_info. out= with async_op, with an input that requires grad, or malformed, raises on every rank
    (through the collective)."""
    w, rank = ctx.world, ctx.rank
    spec = Spec(200, bs_all(ctx, 5), k=2, e=2 * w, dtype=torch.bfloat16, h=64)
    mine = make_inputs(spec, rank)
    kw = dict(expert_scales=mine.w, global_bs=spec.global_bs)

    def dispatch(**more):
        return mt.dispatch_v2(mine.x, mine.ids, ctx.comm, moe_expert_num=spec.e, **kw, **more)

    want = dispatch()
    valid = int(want.ep_recv_counts[-1])
    fresh = [None if i == 1 else torch.full_like(t, 7) for i, t in enumerate(want)]
    got = dispatch(out=fresh)
    again = dispatch(out=want)  # the earlier result's buffers (expand_x: its window slot)
    exact = dispatch(exact_size=True, out=[None if i == 1 else torch.zeros_like(t)
                                           for i, t in enumerate(want)])
    want_q = dispatch(quant_mode=2)
    got_q = dispatch(quant_mode=2, out=[torch.full_like(t, 5) for t in want_q])
    got_h = dispatch(handle=want.handle, out=[None if i == 1 else torch.full_like(t, 9)
                                              for i, t in enumerate(want)])
    perf = torch.zeros(w, dtype=torch.int64)
    got_p = dispatch(performance_info=perf, out=[None if i == 1 else torch.full_like(t, 4)
                                                 for i, t in enumerate(want)])
    y = run_experts(spec, w, rank, want.expand_x, want.expert_token_nums)
    ckw = dict(global_bs=spec.global_bs)
    combined = mt.combine_v2(y, mine.ids, want[2], want[4], mine.w, ctx.comm,
                             moe_expert_num=spec.e, **ckw)
    x_out = torch.full_like(combined, 3)
    into = mt.combine_v2(y, mine.ids, want[2], want[4], mine.w, ctx.comm,
                         moe_expert_num=spec.e, out=x_out, **ckw)
    errors = []
    for call in (lambda: dispatch(out=fresh, async_op=True),
                 lambda: dispatch(out=fresh[:3]),
                 lambda: mt.combine_v2(y, mine.ids, want[2], want[4], mine.w, ctx.comm,
                                       moe_expert_num=spec.e, out=[x_out], **ckw),
                 lambda: mt.dispatch_v2(mine.x.clone().requires_grad_(), mine.ids, ctx.comm,
                                        moe_expert_num=spec.e, out=fresh, **kw),
                 lambda: dispatch(out=[torch.empty(3)] + fresh[1:])):
        try:
            call()
            errors.append(None)
        except moe_ep.Error as err:
            errors.append(err)
    want_errors = [
        (moe_ep.UnsupportedError, "dispatch_v2: out= with async_op=True is unsupported"),
        (moe_ep.InvalidArgumentError, "dispatch_v2: out = "),
        (moe_ep.InvalidArgumentError, "combine_v2: out = "),
        (moe_ep.UnsupportedError, "dispatch_v2: out= does not support autograd, and x requires "
                                  "grad"),
        (moe_ep.InvalidArgumentError, "dispatch_v2: out.expand_x is "),
    ]

    def same(a, b, rows=None):
        a, b = (a, b) if rows is None else (a[:rows], b[:rows])
        return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))

    def checks():
        for i, (g, f) in enumerate(zip(got, fresh)):
            if f is not None:
                check(g is f, f"output {i} is not the tensor given")
        check(same(got.expand_x, want.expand_x, valid), "expand_x (valid rows) differs")
        check(same(got.assist_info_for_combine, want.assist_info_for_combine, 3 * valid),
              "assist_info_for_combine differs")
        for i in (3, 4, 5):
            check(same(got[i], want[i]), f"output {i} differs")
        check(same(got.expand_scales, want.expand_scales, valid), "expand_scales differs")
        check(again.expand_x is want.expand_x and same(again.ep_recv_counts, got.ep_recv_counts),
              "the earlier result as out")
        check(exact.expand_x.shape[0] == valid and same(exact.expand_x, got.expand_x, valid),
              f"exact_size into out: {tuple(exact.expand_x.shape)}, valid {valid}")
        check(into is x_out and same(into, combined), "combine_v2 into out differs")
        valid_q = int(want_q.ep_recv_counts[-1])
        for name, g, ref, rows in (("quant_mode 2", got_q, want_q, valid_q),
                                   ("handle", got_h, want, valid),
                                   ("performance_info", got_p, want, valid)):
            check(same(g.expand_x, ref.expand_x, rows) and
                  same(g.expand_scales, ref.expand_scales, rows) and
                  same(g.dynamic_scales, ref.dynamic_scales, rows if name == "quant_mode 2"
                       else None) and
                  same(g.assist_info_for_combine, ref.assist_info_for_combine, 3 * rows) and
                  all(same(g[i], ref[i]) for i in (3, 4, 5)), f"out= with {name} differs")
        check(got_q.dynamic_scales.numel() > 0 and got_q.expand_x.dtype == torch.int8,
              "quant_mode 2: no int8 rows or dynamic_scales")
        for err, (kind, start) in zip(errors, want_errors):
            check(type(err) is kind and str(err).startswith(start),
                  f"raised {err!r}, want {kind.__name__}({start!r}...)")

    agreed(ctx, checks)
    round_trip(ctx, Spec(201, bs_all(ctx, 3), k=2, e=2 * w))  # the communicator still works


@case()
def shm_grow_option(ctx):
    """group_id(comm, shm_window_bytes=N, shm_grow=False) (CommOptions::shm_grow, comm.h): the
    registration makes the window and no op grows it. With room for one output, three round
    trips whose outputs stay alive are all right (round_trip checks every value; the later ones
    move their rows by messages). A later shm_grow=True raises naming the registered False;
    shm_grow=False without a size, and a shm_grow that is not a bool, raise on every rank at once
    (nothing duplicated)."""
    w, rank = ctx.world, ctx.rank
    spec = Spec(190, bs_all(ctx, 6), k=2, e=2 * w, dtype=torch.bfloat16, h=256)
    ws = workspace_of(ctx, spec)
    size = ws.shm_slot_bytes if shm_transport() else 1 << 20
    dup, other = ctx.comm.Dup(), ctx.comm.Dup()
    errors = []
    try:
        gid = mt.group_id(dup, shm_window_bytes=size, shm_grow=False)
        registered = mt.distributed._groups[gid].shm_grow
        sub = Ctx(dup, w, rank)
        live = [round_trip(sub, replace(spec, seed=190 + i))[0].expand_x for i in range(3)]
        for call in (lambda: mt.group_id(dup, shm_grow=True),
                     lambda: mt.group_id(other, shm_grow=False),
                     lambda: mt.group_id(other, shm_window_bytes=size, shm_grow="no")):
            try:
                call()
                errors.append(None)
            except moe_ep.Error as err:
                errors.append(err)
        want = ["group_id: shm_grow = True differs from the False this communicator was "
                "registered with (release_group it first, on every rank)",
                "Communicator: shm_grow = false needs shm_window_bytes > 0 (the window is made "
                "once, with that size; see dispatch_workspace for the bytes a call needs), got 0",
                "group_id: shm_grow = 'no' must be True, False or None"]

        def checks():
            check(registered is False, f"registered shm_grow {registered!r}")
            check(len(live) == 3, "round trips")
            for err, message in zip(errors, want):
                check(type(err) is moe_ep.InvalidArgumentError and str(err) == message,
                      f"raised {err!r}, want InvalidArgumentError({message!r})")
            check(id(other) not in mt.distributed._by_object, "other was registered")

        agreed(ctx, checks)
    finally:
        for c in (dup, other):
            if id(c) in mt.distributed._by_object:
                mt.release_group(c)
            c.Free()


@case()
def shm_window_bytes_option(ctx):
    """group_id(comm, shm_window_bytes=N) (CommOptions::shm_window_bytes, comm.h): the duplicate
    has N; a later different value (of timeout_s too) raises InvalidArgumentError naming it and
    the registered one (by communicator and by group id); -1 raises the C++ message on every rank
    at once, leaving the communicator unregistered (no rank went into the collective
    MPI_Comm_dup). N sized with dispatch_workspace for n live outputs and a combine: n round
    trips on it, their outputs all kept alive, lie side by side within N bytes, as in one window
    of N bytes (without the reservation the window holds fewer, and a later call receives into
    ordinary memory elsewhere)."""
    w, rank, n = ctx.world, ctx.rank, 5
    # H large enough that n slots exceed the default window (max(twice one call, 1 MiB))
    spec = Spec(160, bs_all(ctx, 10), k=3, e=4 * w, dtype=torch.bfloat16, h=4096)
    ws = workspace_of(ctx, spec)
    shm = shm_transport()
    reserve = n * ws.shm_slot_bytes + ws.shm_stage_bytes if shm else 1 << 21
    dup, other = ctx.comm.Dup(), ctx.comm.Dup()
    groups = mt.distributed._groups
    try:
        gid = mt.group_id(dup, shm_window_bytes=reserve)
        registered = groups[gid].shm_window_bytes
        again = [mt.group_id(dup, shm_window_bytes=reserve), mt.group_id(dup),
                 mt.group_id(gid, shm_window_bytes=reserve)]
        timeout = groups[gid].timeout_s
        differ = []  # (the error, the message it must have)
        for target in (dup, gid):
            for option, value, have, unit in (("shm_window_bytes", reserve + 4096, reserve,
                                               "bytes"), ("timeout_s", timeout + 1, timeout, "s")):
                want = (f"group_id: {option} = {value} differs from the {have} {unit} this "
                        "communicator was registered with (release_group it first, on every rank)")
                try:
                    mt.group_id(target, **{option: value})
                    differ.append((None, want))
                except moe_ep.Error as err:
                    differ.append((err, want))
        start, negative = time.monotonic(), None
        try:
            mt.group_id(other, shm_window_bytes=-1)
        except moe_ep.Error as err:
            negative = err
        took = time.monotonic() - start
        other_registered = id(other) in mt.distributed._by_object

        def option_checks():
            check(registered == reserve, f"shm_window_bytes {registered}, registered {reserve}")
            check(again == [gid] * 3, f"group_id again: {again}, want {gid}")
            for err, want in differ:
                check(type(err) is moe_ep.InvalidArgumentError and str(err) == want,
                      f"raised {err!r}, want InvalidArgumentError({want!r})")
            check(type(negative) is moe_ep.InvalidArgumentError
                  and str(negative) == "Communicator: shm_window_bytes = -1 must be >= 0 (0: "
                  "sized by the first op)", f"shm_window_bytes = -1 raised {negative!r}")
            check(took < 20, f"shm_window_bytes = -1 took {took:.1f} s to fail")
            check(not other_registered, "the communicator was registered despite the error")

        agreed(ctx, option_checks)
        # registered afterwards (collective, every rank), with the default 0
        default = groups[mt.group_id(other)].shm_window_bytes
        sub = Ctx(dup, w, rank)
        live = [round_trip(sub, replace(spec, seed=160 + i))[0].expand_x for i in range(n)]

        def window_checks():
            check(default == 0, f"default shm_window_bytes {default}")
            if not shm:
                return
            spans = sorted((t.data_ptr(), t.data_ptr() + nbytes(t)) for t in live)
            for (_, end), (begin, _) in zip(spans, spans[1:]):
                check(end <= begin, f"two live expand_x overlap: {spans}")
            extent = spans[-1][1] - spans[0][0]
            check(extent <= reserve, f"the {n} live expand_x span {extent} bytes, more than "
                  f"the {reserve}-byte window: not all in it ({spans})")

        agreed(ctx, window_checks)

        # The README's order on one communicator: query the sizes with it (which registers it),
        # then give it its window: registered again with the option, until an op uses it (on
        # `queried` the option is set before the op, on `used` only after it: refused).
        queried, used = ctx.comm.Dup(), ctx.comm.Dup()
        try:
            first = workspace_of(ctx, spec, group_ep=queried)
            set_to = groups[mt.group_id(queried, shm_window_bytes=reserve)].shm_window_bytes
            workspace_of(ctx, spec, group_ep=used)
            late = []
            for c in (queried, used):
                round_trip(Ctx(c, w, rank), replace(spec, seed=170))
                try:
                    mt.group_id(c, shm_window_bytes=reserve + 4096)
                    late.append(None)
                except moe_ep.Error as err:
                    late.append(err)

            def query_then_window_checks():
                check(isinstance(first, mt.DispatchWorkspace), f"query raised {first!r}")
                check(set_to == reserve,
                      f"shm_window_bytes {set_to} after the query, registered {reserve}")
                for err in late:
                    check(type(err) is moe_ep.InvalidArgumentError,
                          f"a new shm_window_bytes after an op raised {err!r}, want "
                          "InvalidArgumentError (fixed once an op has used the communicator)")

            agreed(ctx, query_then_window_checks)
        finally:
            for c in (queried, used):
                mt.release_group(c)
                c.Free()
    finally:
        for c in (dup, other):
            mt.release_group(c)
            c.Free()


@case()
def performance_info_in_place(ctx):
    w = ctx.world
    start = 10**12
    # a (W,) view inside a bigger buffer: the op must write through it, and only into it
    buf = torch.full((w + 2,), start, dtype=torch.int64)
    buf[0] = buf[-1] = -7
    perf = buf[1 : w + 1]
    ptr = perf.data_ptr()
    spec = Spec(40, bs_all(ctx, 4), k=2, e=2 * w)
    mine = make_inputs(spec, ctx.rank)
    out = mt.dispatch_v2(mine.x, mine.ids, ctx.comm, moe_expert_num=spec.e, performance_info=perf)
    after_dispatch = perf.clone()
    got = mt.combine_v2(out[0], mine.ids, out[2], out[4], mine.w, ctx.comm, moe_expert_num=spec.e,
                        performance_info=perf)
    check(perf.data_ptr() == ptr and perf.dtype == torch.int64, "performance_info was replaced")
    check(int(buf[0]) == -7 and int(buf[-1]) == -7, f"wrote outside performance_info: {buf}")
    # added to, never zeroed: at least the start value, and at most a minute of waiting more
    for name, t in (("dispatch", after_dispatch), ("combine", perf)):
        check(bool((t >= start).all()) and bool((t < start + 60 * 10**6).all()),
              f"performance_info after {name}: {t.tolist()} (started at {start})")
    check(bool((perf >= after_dispatch).all()), f"combine decreased performance_info: {perf}")
    check(got.shape == mine.x.shape, "combine shape")
    # through the custom op itself: the mutation is declared in the schema
    schema = torch.ops.moe_ep.dispatch_v2.default._schema
    arg = next(a for a in schema.arguments if a.name == "performance_info")
    check(arg.alias_info is not None and arg.alias_info.is_write, f"schema: {schema}")


@case()
def bad_expert_id_on_one_rank(ctx):
    w, rank, bad = ctx.world, ctx.rank, ctx.world - 1
    spec = Spec(50, bs_all(ctx, 4), k=2, e=2 * w)
    mine = make_inputs(spec, rank)
    ids = mine.ids.clone()
    if rank == bad:
        ids[1, 1] = spec.e + 3  # outside [0, E): no special experts configured
    seen = None
    try:
        mt.dispatch_v2(mine.x, ids, ctx.comm, moe_expert_num=spec.e)
    except moe_ep.Error as err:
        seen = err
    want = moe_ep.InvalidArgumentError if rank == bad else moe_ep.RemoteError

    def dispatch_error():
        check(type(seen) is want, f"dispatch_v2: rank {rank} raised {seen!r}, want {want.__name__}")
        check("expert_ids" in str(seen) and str(spec.e + 3) in str(seen),
              f"message does not name expert_ids and the value: {seen}")

    agreed(ctx, dispatch_error)
    # combine with a wrong expert_scales shape on one rank
    out = mt.dispatch_v2(mine.x, mine.ids, ctx.comm, moe_expert_num=spec.e)
    scales = mine.w[:, :1] if rank == bad else mine.w
    seen = None
    try:
        mt.combine_v2(out[0], mine.ids, out[2], out[4], scales, ctx.comm, moe_expert_num=spec.e)
    except moe_ep.Error as err:
        seen = err
    combine_error = seen

    def combine_error_checks():
        check(type(combine_error) is want,
              f"combine_v2: rank {rank} raised {combine_error!r}, want {want.__name__}")
        check("expert_scales" in str(combine_error),
              f"message does not name expert_scales: {combine_error}")

    agreed(ctx, combine_error_checks)
    # the communicator keeps working
    round_trip(ctx, Spec(51, bs_all(ctx, 4), k=2, e=2 * w))


@case(min_world=2)
def split_communicators_and_handle_reuse(ctx):
    """Ops on sub-communicators (Split), and a freed communicator whose Fortran handle MPI gives
    to a new communicator with other members: the new one must get its own duplicate (keyed by
    object, not by handle), or rows would travel between the old group's members."""
    w, rank = ctx.world, ctx.rank
    color_a = rank % 2
    a = ctx.comm.Split(color_a)
    sub = Ctx(a, a.Get_size(), a.Get_rank())
    round_trip(sub, Spec(70 + color_a, bs_all(sub, 3), k=2, e=2 * sub.world))
    gid_a = mt.group_id(a)
    handle_a = a.py2f()
    a.Free()
    # ranks {0, w-1} and the rest: other members than a's for w >= 3
    color_b = 0 if rank in (0, w - 1) else 1
    b = ctx.comm.Split(color_b)
    sub = Ctx(b, b.Get_size(), b.Get_rank())
    gid_b = mt.group_id(b)
    check(gid_b != gid_a, f"new communicator (handle {b.py2f()}, freed one {handle_a}) reused "
          f"the freed one's group id {gid_a}")
    # different seeds per color: a row from the wrong group cannot look right
    round_trip(sub, Spec(80 + color_b, bs_all(sub, 3), k=2, e=2 * sub.world))
    mt.release_group(b)
    b.Free()


@case(min_world=2)
def overlapping_calls_from_two_threads(ctx):
    """A second call on a communicator while another thread's call is still in it raises
    InvalidArgumentError at once (it would otherwise pair its messages with the other thread's
    across ranks); the first call completes normally."""
    import threading

    spec = Spec(90, bs_all(ctx, 3), k=2, e=2 * ctx.world)
    mine = make_inputs(spec, ctx.rank)
    first = {}

    def run_first():
        try:
            if ctx.rank == 0:
                time.sleep(1.0)  # the others wait inside dispatch_v2 for rank 0 meanwhile
            first["out"] = mt.dispatch_v2(mine.x, mine.ids, ctx.comm, moe_expert_num=spec.e)
        except Exception as err:  # reported below
            first["err"] = err

    mt.group_id(ctx.comm)  # registered (collective) before the threads start
    t = threading.Thread(target=run_first)
    t.start()
    second = None
    if ctx.rank != 0:
        time.sleep(0.3)
        try:
            mt.dispatch_v2(mine.x, mine.ids, ctx.comm, moe_expert_num=spec.e)
        except moe_ep.Error as err:
            second = err
    t.join(timeout=120)

    def checks():
        check(not t.is_alive(), "the first call did not finish")
        check("err" not in first, f"the first call failed: {first.get('err')!r}")
        if ctx.rank != 0:
            check(isinstance(second, moe_ep.InvalidArgumentError)
                  and "in use by another thread" in str(second),
                  f"overlapping call raised {second!r}")

    agreed(ctx, checks)
    round_trip(ctx, Spec(91, bs_all(ctx, 3), k=2, e=2 * ctx.world))  # still usable


@case(min_world=2)
def unconvertible_tensor_on_one_rank(ctx):
    """A tensor the binding cannot take (fp64) on one rank: that rank raises UnsupportedError
    naming it, and the others RemoteError at once (the error travels in the op's header), not
    TimeoutError after the communicator's deadline."""
    w, rank, bad = ctx.world, ctx.rank, ctx.world - 1
    spec = Spec(55, bs_all(ctx, 4), k=2, e=2 * w)
    mine = make_inputs(spec, rank)
    want = moe_ep.UnsupportedError if rank == bad else moe_ep.RemoteError

    def raised_everywhere(op, name, call):
        # call() raises `want` on this rank, promptly, naming the op and the tensor's dtype.
        start, seen = time.monotonic(), None
        try:
            call()
        except moe_ep.Error as err:
            seen = err
        took = time.monotonic() - start

        def checks():
            check(type(seen) is want, f"{op}: rank {rank} raised {seen!r}, want {want.__name__}")
            check(op in str(seen) and f"{name} dtype" in str(seen),
                  f"message does not name the op and {name}'s dtype: {seen}")
            check(took < 20, f"{op} took {took:.1f} s to fail: a timeout, not the error")

        agreed(ctx, checks)

    x = mine.x.double() if rank == bad else mine.x
    raised_everywhere("dispatch_v2", "x",
                      lambda: mt.dispatch_v2(x, mine.ids, ctx.comm, moe_expert_num=spec.e))
    out = mt.dispatch_v2(mine.x, mine.ids, ctx.comm, moe_expert_num=spec.e)
    y = out[0].double() if rank == bad else out[0]
    raised_everywhere("combine_v2", "expand_x",
                      lambda: mt.combine_v2(y, mine.ids, out[2], out[4], mine.w, ctx.comm,
                                            moe_expert_num=spec.e))
    round_trip(ctx, Spec(56, bs_all(ctx, 4), k=2, e=2 * w))  # the communicator still works


def _opcheck_args(ctx):
    spec = Spec(60, bs_all(ctx, 5), k=2, e=2 * ctx.world)
    mine = make_inputs(spec, ctx.rank)
    gid = mt.group_id(ctx.comm)
    return spec, mine, gid


def dispatch_prefixes(outs):
    """dispatch_v2's outputs with expand_x cut to its valid rows and assist_info_for_combine to
    its first 3 * valid entries (SPEC §1.4: only those are meaningful, the rest is whatever the
    memory held and differs between two calls), without the handle (an id that names each
    call's plan: it differs between two calls by design), and the shapes of all of them, uncut."""
    recv = outs[4]
    valid = int(recv[-1]) if recv.numel() else 0
    cut = list(outs[:7])
    cut[0], cut[2] = outs[0][:valid], outs[2][: 3 * valid]
    return cut, [tuple(t.shape) for t in outs]


def opcheck_dispatch(args, kwargs):
    """torch.library.opcheck of dispatch_v2. Its test_aot_dispatch_dynamic compares the outputs
    of two calls (eager, then under AOTDispatcher) whole, so it would compare the unspecified
    tails of expand_x and assist_info_for_combine; that test runs here as opcheck runs it
    (aot_autograd_check with dynamic shapes on cloned inputs) but compares the meaningful prefixes
    exactly, and every shape."""
    import torch.utils._pytree as pytree
    from torch.testing._internal.optests.aot_autograd import aot_autograd_check

    op = torch.ops.moe_ep.dispatch_v2.default
    rest = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(op, args, kwargs, test_utils=rest)

    def func(*a, **kw):  # as opcheck's: aot_autograd_check calls it more than once
        a, kw = pytree.tree_map_only(Tensor, torch.clone, (a, kw))
        return op(*a, **kw)

    def equal(got, want, msg=None):
        (g, g_shapes), (w, w_shapes) = dispatch_prefixes(got), dispatch_prefixes(want)
        check(g_shapes == w_shapes, f"{msg}: shapes {g_shapes} != {w_shapes}")
        torch.testing.assert_close(g, w, rtol=0, atol=0, msg=msg)

    aot_autograd_check(
        func, args, kwargs, dynamic=True, check_gradients="auto", assert_equals_fn=equal
    )


@case()
def handle_errors(ctx):
    """A handle that is not one, or names no live plan, on one rank: that rank raises
    InvalidArgumentError naming it, the others RemoteError; then a good call works."""
    spec = Spec(61, bs_all(ctx, 3), k=2, e=2 * ctx.world)
    mine = make_inputs(spec, ctx.rank)
    d = mt.dispatch_v2(mine.x, mine.ids, ctx.comm, moe_expert_num=spec.e)
    bad = {0: torch.zeros(1), 1: torch.tensor([10**9], dtype=torch.int64)}
    for which, message in ((0, "handle must be the handle tensor dispatch_v2 returned"),
                           (1, "names no live dispatch_v2 plan")):
        handle = bad[which] if ctx.rank == 0 else d.handle
        try:
            mt.combine_v2(d.expand_x, mine.ids, None, None, mine.w, ctx.comm, moe_expert_num=spec.e,
                          handle=handle)
            raise CaseFailure("a bad handle was accepted")
        except moe_ep.InvalidArgumentError as e:
            check(ctx.rank == 0 and message in str(e), f"rank {ctx.rank}: {e}")
        except moe_ep.RemoteError as e:
            check(ctx.rank != 0 and "rank 0 failed" in str(e) and message in str(e), str(e))
    got = mt.combine_v2(d.expand_x, mine.ids, None, None, mine.w, ctx.comm, moe_expert_num=spec.e,
                        handle=d.handle)
    want = mt.combine_v2(d.expand_x, mine.ids, d.assist_info_for_combine, d.ep_recv_counts, mine.w,
                         ctx.comm, moe_expert_num=spec.e)
    agreed(ctx, lambda: check_bitwise("combine_v2 with the handle", got, want))


@case(only=2)
def opcheck_dispatch_combine(ctx):
    spec, mine, gid = _opcheck_args(ctx)
    w, r = ctx.world, ctx.rank
    perf = torch.zeros(w, dtype=torch.int64)
    d_args = (mine.x, mine.ids, gid, w, r, spec.e)
    opcheck_dispatch(d_args, {"expert_scales": mine.w, "performance_info": perf})
    opcheck_dispatch(d_args, {"quant_mode": 2})
    out = torch.ops.moe_ep.dispatch_v2(*d_args)
    torch.library.opcheck(
        torch.ops.moe_ep.combine_v2.default,
        (out[0], mine.ids, out[2], out[4], mine.w, gid, w, r, spec.e),
        {"performance_info": perf},
    )


@case()
def fake_and_real_rank_errors_agree(ctx):
    """A tensor of the wrong rank on every rank: the real op raises InvalidArgumentError on each
    rank, and the fake implementation (what torch.compile traces) the same message word for word
    (python/tests/test_front_errors.py checks the fakes alone)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    e = 2 * ctx.world
    gid = mt.group_id(ctx.comm)
    x, ids = torch.randn(4, 8), torch.zeros(4, 2, dtype=torch.int32)
    w = torch.full((4, 2), 0.5)
    calls = [
        ("dispatch_v2", lambda x, ids, w: torch.ops.moe_ep.dispatch_v2(
            x, ids, gid, ctx.world, ctx.rank, e), (x[:, 0], ids, w)),
        ("dispatch_v2", lambda x, ids, w: torch.ops.moe_ep.dispatch_v2(
            x, ids, gid, ctx.world, ctx.rank, e), (x, ids[:, 0], w)),
        ("combine_v2", lambda y, ids, w: torch.ops.moe_ep._combine_v2_functional(
            y, ids, torch.zeros(4096, dtype=torch.int32), torch.zeros(e, dtype=torch.int32), w,
            gid, ctx.world, ctx.rank, e), (x[:, 0], ids, w)),
    ]
    messages = []
    for op, call, args in calls:
        real = fake = None
        try:
            call(*args)
        except moe_ep.InvalidArgumentError as err:
            real = str(err)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fargs = [mode.from_tensor(a) for a in args]
            try:
                call(*fargs)
            except moe_ep.InvalidArgumentError as err:
                fake = str(err)
        messages.append((op, real, fake))

    def checks():
        for op, real, fake in messages:
            check(real is not None and real == fake,
                  f"{op}: real op raised {real!r}, fake implementation {fake!r}")

    agreed(ctx, checks)
    round_trip(ctx, Spec(57, bs_all(ctx, 3), k=2, e=e))  # still in step


@case(only=2)
def compile_fullgraph(ctx):
    """torch.compile(fullgraph=True) of a layer calling the custom ops (group id), and of one
    calling the wrappers (mpi4py communicator, already registered): the outputs equal eager's,
    and the shapes seen while tracing (the fake implementations) equal the real ones."""
    spec, mine, gid = _opcheck_args(ctx)
    w, r, e, comm = ctx.world, ctx.rank, spec.e, ctx.comm

    def finish(x, ids, weights, outs, combine):
        y = outs[0] * 2.0  # every expert doubles its rows
        out = combine(y, ids, outs[2], outs[4], weights)
        # the shapes as seen while tracing, returned as constants
        return (out, *outs), [tuple(t.shape) for t in (out, *outs)]

    def layer_ops(x, ids, weights):
        outs = torch.ops.moe_ep.dispatch_v2(x, ids, gid, w, r, e, expert_scales=weights)
        return finish(x, ids, weights, outs,
                      lambda *a: torch.ops.moe_ep.combine_v2(*a, gid, w, r, e))

    def layer_wrappers(x, ids, weights):
        outs = mt.dispatch_v2(x, ids, comm, moe_expert_num=e, expert_scales=weights)
        return finish(x, ids, weights, outs,
                      lambda *a: mt.combine_v2(*a, comm, moe_expert_num=e))

    results = []
    for layer in (layer_ops, layer_wrappers):
        compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
        results.append((layer.__name__, compiled(mine.x, mine.ids, mine.w),
                        layer(mine.x, mine.ids, mine.w)))

    def checks():
        names = ("combine_v2", "expand_x", "dynamic_scales", "assist_info_for_combine",
                 "expert_token_nums", "ep_recv_counts", "tp_recv_counts", "expand_scales")
        for layer, (got, traced_shapes), (want, _) in results:
            # SPEC §1.4: only the first `valid` rows of expand_x (3 * valid entries of
            # assist_info_for_combine) are meaningful, the rest is whatever the memory held and
            # differs between two calls; so those two are compared on that prefix (shapes whole).
            valid = int(want[5][-1]) if want[5].numel() else 0
            prefix = {"expand_x": valid, "assist_info_for_combine": 3 * valid}
            for name, g, ref, shape in zip(names, got, want, traced_shapes):
                check(tuple(ref.shape) == shape,
                      f"{layer}: fake {name} shape {shape} != real {tuple(ref.shape)}")
                check(tuple(g.shape) == tuple(ref.shape),
                      f"{layer}: compiled {name} shape {tuple(g.shape)} != {tuple(ref.shape)}")
                n = prefix.get(name)
                check_bitwise(f"{layer}: compiled {name}", g if n is None else g[:n],
                              ref if n is None else ref[:n])

    agreed(ctx, checks)


def _raised(call) -> Optional[Exception]:
    try:
        call()
    except moe_ep.Error as e:
        return e
    return None


def _check_raised(what: str, err, cls, needle: str) -> None:
    check(type(err) is cls and needle in str(err),
          f"{what}: raised {err!r}, want {cls.__name__} with {needle!r}")


@case(only=2)
def uneven_bs_without_global_bs(ctx):
    """Issue 30: ranks with BS 0 and 5 and no global_bs. Every rank is told exactly what to pass
    (global_bs = W * max BS, with the numbers), and with that value the round trip gives the
    reference result."""
    spec = Spec(71, (0, 5), k=2, e=4)
    mine = make_inputs(spec, ctx.rank)
    err = _raised(lambda: mt.dispatch_v2(mine.x, mine.ids, ctx.comm, moe_expert_num=spec.e))
    agreed(ctx, lambda: _check_raised(
        "dispatch_v2 without global_bs", err, moe_ep.InvalidArgumentError,
        "dispatch_v2: BS (x.shape[0]) differs across ranks with global_bs = 0: rank 0 has 0, "
        "rank 1 has 5; pass global_bs = ep_world_size * max BS = 2 * 5 = 10 (rank 1 has BS = 5"))
    round_trip(ctx, replace(spec, global_bs=10))


@case(only=2)
def front_messages(ctx):
    """Issue 30: int64 expert_ids (torch.topk's) hint .int(); a dtype the binding cannot take
    lists only the dtypes that parameter takes; combine_v2 with neither a handle nor dispatch_v2's
    layout tensors says it needs one of them; an unregistered group id names the op and the
    parameter. Every rank passes the same mistake (each raises its own error)."""
    spec = Spec(72, bs_all(ctx, 4), k=2, e=2 * ctx.world)
    mine = make_inputs(spec, ctx.rank)
    e = spec.e
    got = {
        "int64 ids": _raised(lambda: mt.dispatch_v2(mine.x, mine.ids.long(), ctx.comm,
                                                    moe_expert_num=e)),
        "fp64 x": _raised(lambda: mt.dispatch_v2(mine.x.double(), mine.ids, ctx.comm,
                                                 moe_expert_num=e)),
        "fp64 scales": _raised(lambda: mt.dispatch_v2(mine.x, mine.ids, ctx.comm,
                                                      moe_expert_num=e,
                                                      expert_scales=mine.w.double())),
    }
    d = mt.dispatch_v2(mine.x, mine.ids, ctx.comm, moe_expert_num=e)
    got["combine without layout"] = _raised(lambda: mt.combine_v2(
        d.expand_x, mine.ids, None, None, mine.w, ctx.comm, moe_expert_num=e))
    got["combine without counts"] = _raised(lambda: mt.combine_v2(
        d.expand_x, mine.ids, d.assist_info_for_combine, None, mine.w, ctx.comm,
        moe_expert_num=e))
    got["unregistered id"] = _raised(lambda: mt.dispatch_v2(mine.x, mine.ids, 987654,
                                                             moe_expert_num=e))
    y = mt.combine_v2(d.expand_x, mine.ids, None, None, mine.w, ctx.comm, moe_expert_num=e,
                      handle=d.handle)  # still in step

    def checks():
        _check_raised("int64 expert_ids", got["int64 ids"], moe_ep.InvalidArgumentError,
                      "dispatch_v2: expert_ids dtype torch.int64 is not one of {torch.int32} "
                      "(torch.topk returns int64 indices: pass expert_ids.int())")
        check(str(got["fp64 x"]) == "dispatch_v2: x dtype torch.float64 is not one of "
              "torch.bfloat16, torch.float16, torch.float32"
              and type(got["fp64 x"]) is moe_ep.UnsupportedError, f"fp64 x: {got['fp64 x']!r}")
        check(str(got["fp64 scales"]) == "dispatch_v2: expert_scales dtype torch.float64 is not "
              "one of torch.float32", f"fp64 expert_scales: {got['fp64 scales']!r}")
        _check_raised("combine_v2 without a handle or the layout",
                      got["combine without layout"], moe_ep.InvalidArgumentError,
                      "combine_v2: assist_info_for_combine and ep_send_counts are None and no "
                      "handle is given: combine_v2 needs either handle= (the .handle of the "
                      "dispatch_v2 these rows came from) or that dispatch_v2's "
                      "assist_info_for_combine and ep_recv_counts (as ep_send_counts)")
        _check_raised("combine_v2 without ep_send_counts", got["combine without counts"],
                      moe_ep.InvalidArgumentError,
                      "combine_v2: ep_send_counts is None and no handle is given")
        _check_raised("an unregistered group id", got["unregistered id"],
                      moe_ep.InvalidArgumentError,
                      "dispatch_v2: group_ep = 987654 is not a registered group id (pass the "
                      "mpi4py communicator itself, or the id moe_ep.torch.group_id(comm)")
        check(y.shape == mine.x.shape, "the round trip after the errors failed")

    agreed(ctx, checks)


@case(only=2)
def int8_modes_refuse_autograd_at_the_forward(ctx):
    """Issue 30: quant_mode 2 (dispatch_v2) and comm_quant_mode 2 (combine_v2) have no gradient:
    with grad mode on and an input that requires grad they raise UnsupportedError at the forward,
    naming the op and the parameter (not an expand_x silently without grad, nor an error at
    backward()). Under torch.no_grad(), or with detached inputs, they run."""
    spec = Spec(73, bs_all(ctx, 4), k=2, e=2 * ctx.world)
    mine = make_inputs(spec, ctx.rank)
    e = spec.e
    x = mine.x.clone().requires_grad_()
    err_d = _raised(lambda: mt.dispatch_v2(x, mine.ids, ctx.comm, moe_expert_num=e,
                                           quant_mode=2))
    with torch.no_grad():
        q = mt.dispatch_v2(x, mine.ids, ctx.comm, moe_expert_num=e, quant_mode=2)
    d = mt.dispatch_v2(x, mine.ids, ctx.comm, moe_expert_num=e)
    y = d.expand_x * 2  # requires grad
    err_c = _raised(lambda: mt.combine_v2(y, mine.ids, None, None, mine.w, ctx.comm,
                                          moe_expert_num=e, handle=d.handle, comm_quant_mode=2))
    out = mt.combine_v2(y.detach(), mine.ids, None, None, mine.w, ctx.comm, moe_expert_num=e,
                        handle=d.handle, comm_quant_mode=2)

    def checks():
        _check_raised("dispatch_v2 quant_mode 2", err_d, moe_ep.UnsupportedError,
                      "dispatch_v2: quant_mode = 2 has no gradient (SPEC §6: int8 rows have "
                      "none), but x requires grad with grad mode on")
        _check_raised("combine_v2 comm_quant_mode 2", err_c, moe_ep.UnsupportedError,
                      "combine_v2: comm_quant_mode = 2 has no gradient (SPEC §6: int8 rows have "
                      "none), but expand_x requires grad with grad mode on")
        check(q.expand_x.dtype == torch.int8, "quant_mode 2 under no_grad did not run")
        check(out.shape == mine.x.shape and not out.requires_grad,
              "comm_quant_mode 2 on detached rows did not run")

    agreed(ctx, checks)


@case(only=2)
def compile_fullgraph_unregistered_comm(ctx):
    """Issue 30: torch.compile(fullgraph=True) of a layer whose first use of an mpi4py
    communicator is inside the compiled code (Dynamo cannot trace mpi4py's py2f: the group is
    resolved at trace time, as a constant). The output equals eager's, bitwise."""
    from moe_ep.torch import distributed as D

    spec = Spec(74, bs_all(ctx, 5), k=2, e=2 * ctx.world)
    mine = make_inputs(spec, ctx.rank)
    comm = ctx.comm.Dup()
    check(id(comm) not in D._by_object, "the new communicator is registered already")

    def layer(x, ids, weights):
        d = mt.dispatch_v2(x, ids, comm, moe_expert_num=spec.e)
        return mt.combine_v2(d.expand_x * 2.0, ids, None, None, weights, comm,
                             moe_expert_num=spec.e, handle=d.handle)

    torch._dynamo.reset()
    got = torch.compile(layer, fullgraph=True, backend="aot_eager")(mine.x, mine.ids, mine.w)
    want = layer(mine.x, mine.ids, mine.w)
    mt.release_group(comm)
    torch._dynamo.reset()
    comm.Free()
    agreed(ctx, lambda: check_bitwise("compiled layer on an unregistered comm", got, want))


@case(only=4)
def moe_layer_example(ctx):
    """examples/python/moe_layer.py with its default sizes, run as __main__ in this launch (a
    launch of its own would cost as much again in start-up): exit status 0 on every rank, PASS on
    rank 0. Its output is passed on, one write per line."""
    import contextlib
    import io
    import runpy
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "python" / "moe_layer.py"
    buf, argv = io.StringIO(), sys.argv
    sys.argv = [str(path)]
    try:
        with contextlib.redirect_stdout(buf):
            runpy.run_path(str(path), run_name="__main__")
        status = 0
    except SystemExit as e:
        status = e.code
    finally:
        sys.argv = argv
    for line in buf.getvalue().splitlines():
        say(f"moe_layer.py rank={ctx.rank}: {line}")
    lines = buf.getvalue().splitlines()
    check(status == 0, f"moe_layer.py exited with {status!r}: {lines}")
    check(ctx.rank != 0 or "PASS" in lines, f"no PASS line from moe_layer.py: {lines}")


def main(argv: Sequence[str]) -> int:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    ctx = Ctx(comm, comm.Get_size(), comm.Get_rank())
    torch.set_num_threads(1)  # ranks share the cores
    names = list(argv) or case_names(ctx.world)
    failed = 0
    for name in names:
        fn, _ = CASES[name]
        t0 = time.perf_counter()
        try:
            fn(ctx)
            say(f"CASE {name} rank={ctx.rank} OK ({time.perf_counter() - t0:.2f} s)")
        except Exception as err:  # report and go on: the other ranks made the same calls
            failed += 1
            why = f"{type(err).__name__}: {err}".replace("\n", " | ")
            say(f"CASE {name} rank={ctx.rank} FAIL: {why}")
            traceback.print_exc()
    say(f"DONE rank={ctx.rank} failed={failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
