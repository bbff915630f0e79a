"""torch.ops.moe_ep.* (SPEC §4: token permute / unpermute and their gradients) against the
pure-torch reference in reference.py.

What SPEC §4 makes exact is compared bit for bit (assert_same: dtype, shape and the bit pattern,
so even the sign of zero counts): permute and every gather/scatter are data movement; the sums of
unpermute and permute_grad and the grad_probs dot products run in fp32 in a fixed (k, resp. h)
order with each product rounded to fp32, and reference.py follows the same order op by op. Only
the comparisons against *autograd through the reference* (a different summation order, in fp64)
and gradcheck's finite differences use tolerances.
"""

from __future__ import annotations

import gc
import itertools
import os

import pytest
import torch
from torch.autograd import gradcheck

import moe_ep
import moe_ep.torch as mt
from moe_ep.torch._convert import dl

import reference as ref

ops = torch.ops.moe_ep

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
NS = [0, 1, 7, 64]
TOPKS = [1, 2, 8]
HS = [1, 5, 64]
NUM_EXPERTS = 6  # few experts: many ties, so the stability of the sort is exercised
GRID = list(itertools.product(DTYPES, NS, TOPKS, HS))


def _grid_id(case):
    dtype, n, topk, h = case
    return f"{str(dtype).split('.')[-1]}-N{n}-K{topk}-H{h}"


GRID_IDS = [_grid_id(c) for c in GRID]


# ---------------------------------------------------------------------------------------------
# Helpers


def _bits(t: torch.Tensor) -> torch.Tensor:
    if t.dtype in (torch.bfloat16, torch.float16):
        return t.view(torch.int16)
    if t.dtype == torch.float32:
        return t.view(torch.int32)
    return t


def assert_same(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """Bitwise equality: dtype, shape and every bit (NaN-free inputs; -0 differs from +0)."""
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    a, e = _bits(actual), _bits(expected)
    if not torch.equal(a, e):
        where = (a != e).nonzero()
        first = tuple(where[0].tolist())
        raise AssertionError(
            f"{what}: {where.shape[0]} of {a.numel()} elements differ; first at {first}: "
            f"{actual[first].item()!r} != {expected[first].item()!r}"
        )


def assert_close64(actual: torch.Tensor, expected64: torch.Tensor, atol: float, what: str = ""):
    """actual (bf16/fp16/fp32) against an fp64 oracle: within two of actual's ulps (relative)
    plus atol (the fp32 accumulation error of a short sum)."""
    eps = torch.finfo(actual.dtype).eps
    torch.testing.assert_close(
        actual.double(), expected64, rtol=2 * eps, atol=atol, msg=lambda m: f"{what}: {m}"
    )


def make_tokens(n: int, h: int, dtype: torch.dtype) -> torch.Tensor:
    x = torch.randn(n, h).to(dtype)
    # Signed zeros: SPEC's sums start at the first present term, so a lone -0 term stays -0.
    x[::3, 0] = -0.0
    return x


def make_indices(n: int, topk: int, routing: str, index_dtype: torch.dtype, one_d: bool):
    if routing == "skewed":  # every token to one expert
        idx = torch.full((n, topk), 3, dtype=index_dtype)
    else:
        idx = torch.randint(0, NUM_EXPERTS, (n, topk), dtype=index_dtype)
    return idx[:, 0] if one_d else idx


def index_kinds(topk: int):
    """(index dtype, 1-D?) to try; 1-D indices mean topK = 1."""
    kinds = [(torch.int32, False), (torch.int64, False)]
    if topk == 1:
        kinds += [(torch.int32, True), (torch.int64, True)]
    return kinds


def num_out_cases(m: int):
    """None, 0 (keep all), positive (below and above M), negative (drop some, drop all)."""
    cases = [None]
    for n in (0, m // 2 + 1, m + 5, -(m // 3), -m):
        if n not in cases:
            cases.append(n)
    return cases


def make_sorted_indices(m: int, layout: str):
    """sorted_indices (M,) int32 with distinct values in [0, max(P, M)), and P:
    'permutation': P = M, every row referred to once;
    'dropped': P < M, the entries pointing at P.. are dropped tokens;
    'sparse': P > M, some rows of permuted_tokens nothing refers to."""
    p = {"permutation": m, "dropped": m - (m + 2) // 3, "sparse": m + 3}[layout]
    s = torch.randperm(max(p, m))[:m].to(torch.int32)
    return s, p


def make_probs(n: int, topk: int, dtype: torch.dtype) -> torch.Tensor:
    probs = torch.rand(n, topk).to(dtype)
    if probs.numel():
        probs.view(-1)[0] = 0.0  # a zero weight: 0 * x must still be added (0 * -0 = -0 ...)
    return probs


# ---------------------------------------------------------------------------------------------
# The oracle itself against SPEC §4.1's definitions (so a wrong reference cannot hide a bug).


@pytest.mark.parametrize("num_out_tokens", [None, 5, -4])
def test_reference_permute_follows_spec(num_out_tokens):
    n, topk = 9, 3
    x = torch.arange(n, dtype=torch.float32)[:, None] * torch.ones(1, 2)  # row i holds i
    idx = torch.randint(0, 4, (n, topk))
    p, s = ref.permute(x, idx, num_out_tokens)
    m = n * topk
    rows = ref.num_rows(m, num_out_tokens)
    assert s.dtype == torch.int32 and sorted(s.tolist()) == list(range(m))
    flat = idx.reshape(-1).tolist()
    # Entry j sits at row s[j]; rows are ordered by (expert id, j): a stable sort.
    by_row = sorted(range(m), key=lambda j: s[j].item())
    assert by_row == sorted(range(m), key=lambda j: (flat[j], j))
    assert p.shape == (rows, 2)
    for j in range(m):
        if s[j] < rows:
            assert p[s[j]].tolist() == [j // topk] * 2
    # Dropped entries are the highest expert ids.
    kept = [flat[j] for j in range(m) if s[j] < rows]
    dropped = [flat[j] for j in range(m) if s[j] >= rows]
    assert not kept or not dropped or max(kept) <= min(dropped)


def test_reference_unpermute_grad_follows_spec():
    n, topk, h, p = 3, 2, 4, 7
    s = torch.tensor([5, 0, 6, 2, 3, 4], dtype=torch.int32)  # 1 unreferenced row; none dropped
    probs = torch.tensor([[0.5, 2.0], [1.0, 0.25], [3.0, 1.5]])
    g = torch.randn(n, h)
    x = torch.randn(p, h)
    gp, gprobs = ref.unpermute_grad(g, s, p, torch.float32, probs, x)
    assert torch.equal(gp[1], torch.zeros(h))  # nothing refers to row 1
    for j in range(n * topk):
        i, k = divmod(j, topk)
        assert torch.equal(gp[s[j]], g[i] * probs[i, k])
        assert torch.allclose(gprobs[i, k], (g[i].double() @ x[s[j]].double()).float())


# ---------------------------------------------------------------------------------------------
# Forward of each op over the grid, bitwise against the reference.


@pytest.mark.parametrize("routing", ["random", "skewed"])
@pytest.mark.parametrize("dtype,n,topk,h", GRID, ids=GRID_IDS)
def test_token_permute(dtype, n, topk, h, routing):
    x = make_tokens(n, h, dtype)
    x_before = x.clone()
    for index_dtype, one_d in index_kinds(topk):
        idx = make_indices(n, topk, routing, index_dtype, one_d)
        for num_out in num_out_cases(idx.numel()):
            what = f"indices {index_dtype} 1-D={one_d} num_out_tokens={num_out}"
            p, s = ops.token_permute(x, idx, num_out)
            rp, rs = ref.permute(x, idx, num_out)
            assert_same(s, rs, f"sorted_indices, {what}")
            assert_same(p, rp, f"permuted_tokens, {what}")
    assert_same(x, x_before, "tokens must not be modified")


@pytest.mark.parametrize("routing", ["random", "skewed"])
@pytest.mark.parametrize("dtype,n,topk,h", GRID, ids=GRID_IDS)
def test_token_permute_grad(dtype, n, topk, h, routing):
    x = make_tokens(n, h, dtype)
    idx = make_indices(n, topk, routing, torch.int64, False)
    m = n * topk
    for num_out in num_out_cases(m):
        _, s = ref.permute(x, idx, num_out)
        # R rows of grad_permuted: the permute's rows, and more rows than M (ignored).
        for r in {ref.num_rows(m, num_out), m + 2}:
            grad = make_tokens(r, h, dtype)
            expected = ref.permute_grad(grad, s, n, topk, dtype)
            what = f"num_out_tokens={num_out} R={r}"
            assert_same(ops.token_permute_grad(x, grad, idx, s), expected, f"v1, {what}")
            assert_same(
                ops.token_permute_grad_v2(grad, s, n, dtype, topk), expected, f"v2, {what}"
            )


def _probs_cases(dtype):
    return [None, torch.float32] + ([dtype] if dtype != torch.float32 else [])


@pytest.mark.parametrize("layout", ["permutation", "dropped", "sparse"])
@pytest.mark.parametrize("dtype,n,topk,h", GRID, ids=GRID_IDS)
def test_token_unpermute(dtype, n, topk, h, layout):
    m = n * topk
    s, p = make_sorted_indices(m, layout)
    x = make_tokens(p, h, dtype)
    for probs_dtype in _probs_cases(dtype):
        probs = None if probs_dtype is None else make_probs(n, topk, probs_dtype)
        what = f"probs {probs_dtype}"
        expected = ref.unpermute(x, s, probs)
        assert expected.shape == (m if probs is None else n, h)
        assert_same(ops.token_unpermute(x, s, probs), expected, what)
        out, saved = ops._token_unpermute(x, s, probs)
        assert_same(out, expected, f"_token_unpermute out, {what}")
        assert_same(saved, x, f"_token_unpermute saved, {what}")
        if saved.numel():
            assert saved.data_ptr() != x.data_ptr(), "the saved tensor must be a copy"
        if probs is not None:
            rs = [n, h]
            assert_same(ops.token_unpermute(x, s, probs, False, rs), expected, f"restore {what}")


@pytest.mark.parametrize("layout", ["permutation", "dropped", "sparse"])
@pytest.mark.parametrize("dtype,n,topk,h", GRID, ids=GRID_IDS)
def test_token_unpermute_grad(dtype, n, topk, h, layout):
    m = n * topk
    s, p = make_sorted_indices(m, layout)
    x = make_tokens(p, h, dtype)
    for probs_dtype in _probs_cases(dtype):
        what = f"probs {probs_dtype}"
        if probs_dtype is None:
            g = make_tokens(m, h, dtype)  # without probs topK = 1: N = M
            exp_gp, _ = ref.unpermute_grad(g, s, p, dtype)
            for name, (gp, gprobs) in {
                "v1": ops.token_unpermute_grad(x, g, s),
                "v2": ops.token_unpermute_grad_v2(g, s, p, dtype),
            }.items():
                assert_same(gp, exp_gp, f"{name} grad_permuted, {what}")
                # A custom op cannot return None: an empty (0,) tensor of grad_out's dtype.
                assert gprobs.shape == (0,) and gprobs.dtype == dtype
            continue
        probs = make_probs(n, topk, probs_dtype)
        g = make_tokens(n, h, dtype)
        exp_gp, exp_gprobs = ref.unpermute_grad(g, s, p, dtype, probs, x)
        for name, (gp, gprobs) in {
            "v1": ops.token_unpermute_grad(x, g, s, probs),
            "v2": ops.token_unpermute_grad_v2(g, s, p, dtype, probs, False, None, x),
        }.items():
            assert_same(gp, exp_gp, f"{name} grad_permuted, {what}")
            assert_same(gprobs, exp_gprobs, f"{name} grad_probs, {what}")


# ---------------------------------------------------------------------------------------------
# Exact round trips and sort paths outside the grid.


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trips(dtype):
    n, h, topk = 37, 16, 4
    x = make_tokens(n, h, dtype)
    idx1 = torch.randint(0, NUM_EXPERTS, (n,))
    p, s = ops.token_permute(x, idx1)
    assert_same(ops.token_unpermute(p, s), x, "topK = 1")
    idx = torch.randint(0, NUM_EXPERTS, (n, topk))
    p, s = ops.token_permute(x, idx)
    # Without probs there is no reduction: one output row per entry.
    assert_same(ops.token_unpermute(p, s), x.repeat_interleave(topk, 0), "no probs")
    # One-hot probs: 1 * x + 0 * (others) == x exactly.
    onehot = torch.nn.functional.one_hot(torch.randint(0, topk, (n,)), topk).to(dtype)
    assert_same(ops.token_unpermute(p, s, onehot), x, "one-hot probs")
    # Dropping rows: a dropped entry contributes nothing (here: a zero row without probs).
    p, s = ops.token_permute(x, idx1, -10)
    out = ops.token_unpermute(p, s)
    kept = s < n - 10
    assert_same(out[kept], x[kept], "kept rows")
    assert torch.equal(out[~kept], torch.zeros(10, h, dtype=dtype))
    assert int(kept.sum()) == n - 10


def test_permute_large_expert_ids():
    # Expert ids beyond the counting sort's range take the comparison sort; still stable.
    x = make_tokens(50, 3, torch.float32)
    big = torch.tensor([0, 5, 70_000, 2**31 - 1, 123_456_789])
    idx = big[torch.randint(0, 5, (50, 2))]
    for num_out in (None, 60, -7):
        p, s = ops.token_permute(x, idx, num_out)
        rp, rs = ref.permute(x, idx, num_out)
        assert_same(s, rs)
        assert_same(p, rp)


def test_thread_count_independent():
    # conftest runs tests on one OpenMP thread; here the parallel paths run on several (the
    # counting sort on per-thread chunks needs M >= 2^14 and M / 4096 >= 2 chunks) and must give
    # the reference's bits, the same as on one thread.
    n, topk, h = 4096, 8, 16
    x = make_tokens(n, h, torch.bfloat16)
    idx = torch.randint(0, 5, (n, topk), dtype=torch.int32)
    probs = make_probs(n, topk, torch.float32)
    g = make_tokens(n, h, torch.bfloat16)

    def run():
        p, s = ops.token_permute(x, idx, -1000)
        return {
            "permuted": p,
            "sorted_indices": s,
            "permute_grad": ops.token_permute_grad_v2(p, s, n, torch.bfloat16, topk),
            "unpermute": ops.token_unpermute(p, s, probs),
            "unpermute_grad": ops.token_unpermute_grad(p, g, s, probs),
        }

    one = run()
    torch.set_num_threads(min(4, max(2, os.cpu_count() or 2)))  # conftest restores it
    many = run()
    rp, rs = ref.permute(x, idx, -1000)
    assert_same(one["sorted_indices"], rs)
    assert_same(one["permuted"], rp)
    assert_same(one["unpermute"], ref.unpermute(rp, rs, probs))
    exp_gp, exp_gprobs = ref.unpermute_grad(g, rs, rp.shape[0], torch.bfloat16, probs, rp)
    assert_same(one["unpermute_grad"][0], exp_gp)
    assert_same(one["unpermute_grad"][1], exp_gprobs)
    assert_same(one["permute_grad"], ref.permute_grad(rp, rs, n, topk, torch.bfloat16))
    for key in one:
        if key == "unpermute_grad":
            assert_same(many[key][0], one[key][0], key)
            assert_same(many[key][1], one[key][1], key)
        else:
            assert_same(many[key], one[key], key)


def test_outputs_outlive_inputs():
    # Outputs own their memory (handed over through DLPack): valid after the inputs are gone.
    x = make_tokens(20, 8, torch.float32)
    idx = torch.randint(0, 4, (20, 2))
    rp, rs = ref.permute(x, idx)
    p, s = ops.token_permute(x.clone(), idx.clone())
    gc.collect()
    _ = [torch.randn(20, 8) for _ in range(10)]  # reuse freed memory
    assert_same(p, rp)
    assert_same(s, rs)


# ---------------------------------------------------------------------------------------------
# Strided and non-contiguous inputs.


def test_strided_rows_are_not_copied():
    # The binding takes strided rows as they are (zero copy); only rows that are not contiguous
    # themselves (stride(-1) != 1) are copied by the front (moe_ep.torch._convert.dl).
    base = torch.randn(14, 5)
    rows = base[::2]
    assert dl(rows).data_ptr() == rows.data_ptr() and dl(rows).stride() == rows.stride()
    stride0 = torch.randn(1, 5).expand(7, 5)
    assert dl(stride0).data_ptr() == stride0.data_ptr()
    cols = torch.randn(5, 7).t()
    assert dl(cols).is_contiguous() and torch.equal(dl(cols), cols)


@pytest.mark.parametrize("dtype", DTYPES)
def test_non_contiguous_inputs(dtype):
    n, topk, h = 11, 3, 6
    x = make_tokens(n, h, dtype)
    idx = torch.randint(0, NUM_EXPERTS, (n, topk))
    rp, rs = ref.permute(x, idx, -5)

    strided = torch.empty(2 * n, h, dtype=dtype)
    strided[::2] = x
    idx_rows = torch.empty(3 * n, topk, dtype=idx.dtype)
    idx_rows[::3] = idx
    idx_cols = torch.empty(n, 2 * topk, dtype=idx.dtype)
    idx_cols[:, ::2] = idx
    for name, xv, iv in [
        ("tokens rows strided", strided[::2], idx),
        ("tokens transposed", x.t().contiguous().t(), idx),  # stride(-1) = n: copied
        ("indices transposed", x, idx.t().contiguous().t()),
        ("indices rows strided", x, idx_rows[::3]),
        ("indices columns strided", x, idx_cols[:, ::2]),
    ]:
        assert not (xv.is_contiguous() and iv.is_contiguous())
        p, s = ops.token_permute(xv, iv, -5)
        assert_same(s, rs, name)
        assert_same(p, rp, name)

    # Every row the same (stride(0) = 0): a broadcast token matrix.
    row = make_tokens(1, h, dtype)
    p, s = ops.token_permute(row.expand(n, h), idx)
    assert_same(p, ref.permute(row.expand(n, h).contiguous(), idx)[0], "stride-0 rows")

    # unpermute: strided permuted rows, transposed probs, strided sorted_indices.
    probs = make_probs(n, topk, torch.float32)
    p, s = ops.token_permute(x, idx)
    expected = ref.unpermute(p, s, probs)
    p_strided = torch.empty(2 * p.shape[0], h, dtype=dtype)
    p_strided[1::2] = p
    s_strided = torch.empty(2 * s.shape[0], dtype=torch.int32)
    s_strided[::2] = s
    probs_t = probs.t().contiguous().t()
    got = ops.token_unpermute(p_strided[1::2], s_strided[::2], probs_t)
    assert_same(got, expected, "unpermute strided")
    # Gradients: an expanded grad_out (stride 0 in rows, and in both dims).
    for g in (make_tokens(1, h, dtype).expand(n, h), torch.ones((), dtype=dtype).expand(n, h)):
        exp_gp, exp_gprobs = ref.unpermute_grad(g.contiguous(), s, p.shape[0], dtype, probs, p)
        gp, gprobs = ops.token_unpermute_grad(p_strided[1::2], g, s_strided[::2], probs_t)
        assert_same(gp, exp_gp, "unpermute_grad expanded grad_out")
        assert_same(gprobs, exp_gprobs, "unpermute_grad expanded grad_out, grad_probs")
    # An all-ones expanded grad_permuted: each token's gradient counts its entries (topK here).
    ones = torch.ones((), dtype=dtype).expand(p.shape[0], h)
    gx = ops.token_permute_grad_v2(ones, s_strided[::2], n, dtype, topk)
    assert torch.equal(gx, torch.full((n, h), float(topk), dtype=dtype))

    # 1-D indices with strided entries.
    p, s = ops.token_permute(strided[::2], idx_rows[::3, 0], 4)
    rp1, rs1 = ref.permute(x, idx[:, 0], 4)
    assert_same(s, rs1, "1-D strided indices")
    assert_same(p, rp1, "1-D strided indices")


# ---------------------------------------------------------------------------------------------
# Autograd through moe_ep.torch.token_permute / token_unpermute.


AUTOGRAD_CASES = [(0, 2, 4), (1, 1, 1), (7, 2, 5), (19, 8, 16)]


def _ref_grads64(fn, inputs, grad):
    """Autograd through the reference in fp64 (an independent summation order)."""
    leaves = [t.detach().double().requires_grad_() for t in inputs]
    out = fn(*leaves)
    if out.requires_grad:  # not when no input element reaches the output (P = 0)
        out.backward(grad.double())
    return [torch.zeros_like(leaf) if leaf.grad is None else leaf.grad for leaf in leaves]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,topk,h", AUTOGRAD_CASES)
def test_permute_backward(dtype, n, topk, h):
    idx = torch.randint(0, NUM_EXPERTS, (n, topk))
    m = n * topk
    for num_out in (None, m // 2 + 1, -(m // 3)):
        x = make_tokens(n, h, dtype).requires_grad_()
        p, s = mt.token_permute(x, idx, num_out)
        assert p.requires_grad and not s.requires_grad
        g = make_tokens(p.shape[0], h, dtype)
        p.backward(g)
        assert_same(x.grad, ref.permute_grad(g, s, n, topk, dtype), f"num_out={num_out}")
        (gx64,) = _ref_grads64(lambda t: ref.permute(t, idx, num_out)[0], [x], g)
        assert_close64(x.grad, gx64, atol=1e-5, what=f"vs fp64 autograd, num_out={num_out}")

    # sum(): the gradient arrives expanded (all strides 0); each token counts its kept entries.
    x = make_tokens(n, h, dtype).requires_grad_()
    p, s = mt.token_permute(x, idx, -(m // 3))
    p.sum().backward()
    kept = (s.view(n, topk) < p.shape[0]).sum(1).to(dtype)
    assert torch.equal(x.grad, kept[:, None].expand(n, h))


@pytest.mark.parametrize("with_saved", [False, True], ids=["token_unpermute", "_token_unpermute"])
@pytest.mark.parametrize("with_probs", [False, True], ids=["no_probs", "probs"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,topk,h", AUTOGRAD_CASES)
def test_unpermute_backward(dtype, n, topk, h, with_probs, with_saved):
    op = (lambda *a: mt._token_unpermute(*a)[0]) if with_saved else mt.token_unpermute
    if not with_probs:
        topk = 1
    for layout in ("permutation", "dropped", "sparse"):
        s, p = make_sorted_indices(n * topk, layout)
        x = make_tokens(p, h, dtype).requires_grad_()
        probs = make_probs(n, topk, torch.float32).requires_grad_() if with_probs else None
        out = op(x, s, probs)
        g = make_tokens(out.shape[0], h, dtype)
        out.backward(g)
        exp_gx, exp_gprobs = ref.unpermute_grad(
            g, s, p, dtype, None if probs is None else probs.detach(), x.detach()
        )
        assert_same(x.grad, exp_gx, f"grad permuted_tokens, {layout}")
        inputs = [x] + ([probs] if with_probs else [])
        grads64 = _ref_grads64(lambda *t: ref.unpermute(t[0], s, *t[1:]), inputs, g)
        assert_close64(x.grad, grads64[0], atol=1e-5, what=f"grad permuted vs fp64, {layout}")
        if with_probs:
            assert_same(probs.grad, exp_gprobs, f"grad probs, {layout}")
            # fp32 dot over H (16 lanes, then a tree) vs an fp64 sum: |error| <= H * eps32 * sum|terms|.
            assert_close64(probs.grad, grads64[1], atol=1e-4, what=f"grad probs vs fp64, {layout}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_layer_backward(dtype):
    # permute -> per-row scaling -> unpermute with probs, against autograd of the reference.
    n, topk, h = 13, 2, 8
    idx = torch.randint(0, NUM_EXPERTS, (n, topk))
    x = make_tokens(n, h, dtype).requires_grad_()
    probs = torch.rand(n, topk).softmax(-1).requires_grad_()
    # Powers of two: exact in every dtype, so the fp64 oracle sees the very values the op sees.
    scale = (2.0 ** torch.randint(-2, 3, (n * topk - 3, 1))).to(dtype)

    def layer(perm, unperm, x, probs):
        p, s = perm(x, idx, -3)
        return unperm(p * scale, s, probs)

    out = layer(mt.token_permute, mt.token_unpermute, x, probs)
    g = make_tokens(n, h, dtype)
    out.backward(g)
    x64, probs64 = (t.detach().double().requires_grad_() for t in (x, probs))
    out64 = layer(ref.permute, ref.unpermute, x64, probs64)
    out64.backward(g.double())
    # out and grad x sum topK products that are each rounded to `dtype` (p * scale before the
    # unpermute; grad_out * probs before the permute's backward): up to topK * eps * |term|.
    atol = max(1e-5, topk * torch.finfo(dtype).eps * 8)
    assert_close64(out, out64, atol=atol, what="out")
    assert_close64(x.grad, x64.grad, atol=atol, what="grad x")
    assert_close64(probs.grad, probs64.grad, atol=1e-4, what="grad probs")


# gradcheck: the kernels take bf16/fp16/fp32 only, so it runs in fp32 rather than fp64. The ops
# are linear (permute; unpermute without probs) or bilinear (unpermute in permuted_tokens and
# probs), so the central difference (f(x+eps) - f(x-eps)) / 2eps has no truncation error: its
# only error is fp32 rounding of the outputs, about 2^-24 * |f| / eps. A large eps (0.01) keeps
# that near 1e-4, well inside atol = rtol = 1e-3, while a wrong gradient (a missing, misplaced
# or misweighted row) is off by O(1).
GRADCHECK = dict(eps=1e-2, atol=1e-3, rtol=1e-3)


@pytest.mark.filterwarnings("ignore:Input #.* is not a double precision")
def test_gradcheck_permute():
    x = torch.randn(6, 3, requires_grad=True)
    idx = torch.randint(0, 4, (6, 2))
    for num_out in (None, 7, -3):
        assert gradcheck(lambda t: mt.token_permute(t, idx, num_out)[0], (x,), **GRADCHECK)
    assert gradcheck(lambda t: mt.token_permute(t, idx[:, 0])[0], (x,), **GRADCHECK)


@pytest.mark.filterwarnings("ignore:Input #.* is not a double precision")
@pytest.mark.parametrize("with_saved", [False, True], ids=["token_unpermute", "_token_unpermute"])
def test_gradcheck_unpermute(with_saved):
    # _token_unpermute's second output is a copy of permuted_tokens: the sum of both outputs
    # checks that a gradient flowing into the copy reaches permuted_tokens too.
    op = (
        (lambda *a: torch.cat([r.flatten() for r in mt._token_unpermute(*a)]))
        if with_saved
        else mt.token_unpermute
    )
    n, topk, h = 5, 2, 3
    for layout in ("permutation", "dropped", "sparse"):
        s, p = make_sorted_indices(n * topk, layout)
        x = torch.randn(p, h, requires_grad=True)
        probs = torch.rand(n, topk, requires_grad=True)
        assert gradcheck(lambda a, b: op(a, s, b), (x, probs), **GRADCHECK)
        s1, p1 = make_sorted_indices(n, layout)
        x1 = torch.randn(p1, h, requires_grad=True)
        assert gradcheck(lambda a: op(a, s1, None), (x1,), **GRADCHECK)


def test_gradient_into_the_saved_copy_reaches_permuted_tokens():
    s, p = make_sorted_indices(8, "permutation")
    x = torch.randn(p, 3, requires_grad=True)
    probs = torch.rand(4, 2)
    out, saved = mt._token_unpermute(x, s, probs)
    (out.sum() + 2 * saved.sum()).backward()
    x2 = x.detach().clone().requires_grad_()
    mt.token_unpermute(x2, s, probs).sum().backward()
    assert torch.equal(x.grad, x2.grad + 2)
    x.grad = None
    _, saved = mt._token_unpermute(x, s, probs)
    saved.sum().backward()  # only the copy is used: grad_out is None
    assert torch.equal(x.grad, torch.ones_like(x))


def test_fp64_is_unsupported():
    # The kernels have no fp64 path; fp64 (gradcheck's default) raises moe_ep.UnsupportedError.
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    idx = torch.randint(0, 3, (4, 2))
    with pytest.raises(moe_ep.UnsupportedError, match="token_permute: tokens"):
        gradcheck(lambda t: mt.token_permute(t, idx)[0], (x,))
    s, p = make_sorted_indices(8, "permutation")
    probs = torch.rand(4, 2, dtype=torch.float64, requires_grad=True)
    with pytest.raises(moe_ep.UnsupportedError, match="token_unpermute: permuted_tokens"):
        gradcheck(lambda a, b: mt.token_unpermute(a, s, b), (torch.randn(p, 3).double(), probs))
    with pytest.raises(moe_ep.UnsupportedError, match="token_unpermute: probs"):
        mt.token_unpermute(torch.randn(p, 3), s, probs)


# ---------------------------------------------------------------------------------------------
# torch.library.opcheck: schema, fake (meta) implementation, autograd registration, and AOT
# dispatch with dynamic shapes, for every registered op.


def _opcheck_cases():
    dtype = torch.float32
    n, topk, h = 6, 2, 4
    m = n * topk
    x = torch.randn(n, h, dtype=dtype)
    idx = torch.randint(0, 3, (n, topk))
    p, s = ops.token_permute(x, idx, m - 3)  # 3 dropped entries
    probs = torch.rand(n, topk)
    g, gm, gp = torch.randn(n, h), torch.randn(m, h), torch.randn(m - 3, h)
    rg = lambda t: t.clone().requires_grad_()  # noqa: E731
    return [
        ("token_permute", (rg(x), idx), {"num_out_tokens": m - 3}),
        ("token_permute", (rg(x), idx[:, 0]), {}),
        ("token_permute", (x, idx.int()), {"num_out_tokens": -2}),
        ("token_permute_grad", (x, gp, idx, s), {}),
        ("token_permute_grad_v2", (gp, s, n, dtype, topk), {}),
        ("token_unpermute", (rg(p), s, rg(probs)), {}),
        ("token_unpermute", (rg(p), s), {}),
        ("token_unpermute", (rg(p), s, probs), {"restore_shape": [n, h]}),
        ("_token_unpermute", (rg(p), s, rg(probs)), {}),
        ("_token_unpermute", (rg(p), s), {}),
        ("token_unpermute_grad", (p, g, s, probs), {}),
        ("token_unpermute_grad", (p, gm, s), {}),
        ("token_unpermute_grad_v2", (g, s, m - 3, dtype, probs, False, None, p), {}),
        ("token_unpermute_grad_v2", (gm, s, m - 3, dtype), {}),
    ]


OPCHECK_CASES = _opcheck_cases()


@pytest.mark.parametrize(
    "name,args,kwargs", OPCHECK_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(OPCHECK_CASES)]
)
def test_opcheck(name, args, kwargs):
    torch.library.opcheck(getattr(ops, name).default, args, kwargs)


def test_every_op_is_opchecked():
    registered = {
        "token_permute",
        "token_permute_grad",
        "token_permute_grad_v2",
        "token_unpermute",
        "_token_unpermute",
        "token_unpermute_grad",
        "token_unpermute_grad_v2",
    }
    assert {c[0] for c in OPCHECK_CASES} == registered
    for name in registered:
        assert hasattr(ops, name)


# ---------------------------------------------------------------------------------------------
# Errors: the moe_ep.Error kind, and a message naming the op, the parameter and the value.


def _error_cases():
    x = torch.randn(4, 3)
    idx = torch.tensor([[1, 0], [0, 2], [1, 1], [2, 0]])
    p, s = ops.token_permute(x, idx)
    probs = torch.rand(4, 2)
    g = torch.randn(4, 3)
    bad_id = idx.clone()
    bad_id[1, 1] = -1
    dup = s.clone()
    dup[1] = dup[0]
    far = s.clone()
    far[0] = 100
    Inv, Uns = moe_ep.InvalidArgumentError, moe_ep.UnsupportedError
    return [
        ("negative expert id", lambda: ops.token_permute(x, bad_id), Inv,
         ["permute", "indices[1,1] = -1 is outside [0, 2147483648)"]),
        ("expert id 2^31", lambda: ops.token_permute(x, torch.full((4, 2), 2**31)), Inv,
         ["permute", "indices[0,0] = 2147483648"]),
        ("1-D expert id", lambda: ops.token_permute(x, torch.tensor([0, 3, -5, 1])), Inv,
         ["permute", "indices[2] = -5"]),
        ("float indices", lambda: ops.token_permute(x, idx.float()), Inv,
         ["permute", "indices dtype fp32"]),
        ("int tokens", lambda: ops.token_permute(x.int(), idx), Inv,
         ["permute", "tokens dtype int32"]),
        ("fp64 tokens", lambda: ops.token_permute(x.double(), idx), Uns,
         ["token_permute", "tokens dtype torch.float64"]),
        ("int16 indices", lambda: ops.token_permute(x, idx.short()), Uns,
         ["token_permute", "indices dtype torch.int16"]),
        ("rows mismatch", lambda: ops.token_permute(x, idx[:3]), Inv,
         ["permute", "indices.shape[0] = 3 must equal 4"]),
        ("3-D indices", lambda: ops.token_permute(x, idx[:, :, None]), Inv,
         ["permute", "indices.ndim = 3"]),
        ("num_out_tokens < -M", lambda: ops.token_permute(x, idx, -9), Inv,
         ["permute", "num_out_tokens = -9"]),
        ("padded_mode token id", lambda: ops.token_permute(x, idx + 3, None, True), Inv,
         ["permute", "indices[0,0] = 4 is outside [0, 4)", "padded_mode"]),
        ("permute_grad H", lambda: ops.token_permute_grad(x, p[:, :2], idx, s), Inv,
         ["permute_grad", "grad_permuted_tokens.shape[1] = 2"]),
        ("permute_grad dtype", lambda: ops.token_permute_grad(x, p.half(), idx, s), Inv,
         ["permute_grad", "grad_permuted_tokens dtype fp16"]),
        ("permute_grad_v2 dtype", lambda: ops.token_permute_grad_v2(p, s, 4, torch.half, 2),
         Inv, ["permute_grad_v2", "tokens_dtype fp16"]),
        ("permute_grad_v2 fp64", lambda: ops.token_permute_grad_v2(p, s, 4, torch.double, 2),
         Uns, ["token_permute_grad_v2", "tokens_dtype = torch.float64"]),
        ("permute_grad_v2 M", lambda: ops.token_permute_grad_v2(p, s, 3, torch.float, 2), Inv,
         ["permute_grad_v2", "sorted_indices.shape[0] = 8 must equal 6"]),
        ("permute_grad_v2 range", lambda: ops.token_permute_grad_v2(p, far, 4, torch.float, 2),
         Inv, ["permute_grad_v2", "sorted_indices[0] = 100 is outside [0, 8)"]),
        ("int64 sorted_indices", lambda: ops.token_unpermute(p, s.long()), Inv,
         ["unpermute", "sorted_indices dtype int64"]),
        ("probs shape", lambda: ops.token_unpermute(p, s, torch.rand(4, 3)), Inv,
         ["unpermute", "sorted_indices.shape[0] = 8 must equal 12"]),
        ("duplicate", lambda: ops.token_unpermute(p, dup), Inv,
         ["unpermute", "sorted_indices[1] = ", "duplicates sorted_indices[0]"]),
        ("out of range", lambda: ops.token_unpermute(p, far, probs), Inv,
         ["unpermute", "sorted_indices[0] = 100 is outside [0, 8)"]),
        ("_unpermute range", lambda: ops._token_unpermute(p, far, probs), Inv,
         ["unpermute_with_saved", "sorted_indices[0] = 100"]),
        ("fp64 permuted", lambda: ops.token_unpermute(p.double(), s), Uns,
         ["token_unpermute", "permuted_tokens dtype torch.float64"]),
        ("fp64 probs", lambda: ops.token_unpermute(p, s, probs.double()), Uns,
         ["token_unpermute", "probs dtype torch.float64"]),
        ("restore_shape", lambda: ops.token_unpermute(p, s, probs, False, [5, 3]), Inv,
         ["token_unpermute", "restore_shape[0] = 5"]),
        ("unpermute_grad H", lambda: ops.token_unpermute_grad(p, torch.randn(4, 4), s, probs),
         Inv, ["unpermute_grad", "permuted_tokens.shape[1] = 3 must equal 4"]),
        ("unpermute_grad dtype", lambda: ops.token_unpermute_grad(p, g.half(), s, probs), Inv,
         ["unpermute_grad", "grad_out dtype fp16"]),
        ("unpermute_grad fp64", lambda: ops.token_unpermute_grad(p, g.double(), s, probs), Uns,
         ["token_unpermute_grad", "grad_out dtype torch.float64"]),
        ("unpermute_grad_v2 no permuted",
         lambda: ops.token_unpermute_grad_v2(g, s, 8, torch.float, probs), Inv,
         ["unpermute_grad_v2", "permuted_tokens is missing"]),
        ("unpermute_grad_v2 rows",
         lambda: ops.token_unpermute_grad_v2(g, s, 9, torch.float, probs, False, None, p), Inv,
         ["unpermute_grad_v2", "permuted_tokens.shape[0] = 8 must equal 9"]),
        ("unpermute_grad_v2 fp64",
         lambda: ops.token_unpermute_grad_v2(g, s, 8, torch.double, probs, False, None, p), Uns,
         ["token_unpermute_grad_v2", "permuted_dtype = torch.float64"]),
        ("autograd fp64", lambda: mt.token_permute(x.double().requires_grad_(), idx), Uns,
         ["token_permute", "tokens dtype torch.float64"]),
    ]


ERROR_CASES = _error_cases()


@pytest.mark.parametrize("name,fn,kind,substrings", ERROR_CASES, ids=[c[0] for c in ERROR_CASES])
def test_errors(name, fn, kind, substrings):
    with pytest.raises(kind) as info:
        fn()
    message = str(info.value)
    for sub in substrings:
        assert sub in message, f"{sub!r} not in {message!r}"
    # The Python base classes users catch: ValueError for bad arguments, NotImplementedError for
    # what is not supported, and moe_ep.Error for both.
    assert isinstance(info.value, moe_ep.Error)
    assert isinstance(info.value, ValueError if kind is moe_ep.InvalidArgumentError
                      else NotImplementedError)
