"""padded_mode (SPEC §4.1, Megatron-LM's capacity layout) through moe_ep.torch's ops: bitwise
against the pure-torch reference (reference.py), close to Megatron-LM's own formulas
(index_select / scatter_add), differentiable, traceable by torch.compile, checked by opcheck, and
its argument errors named, real and fake alike."""

from __future__ import annotations

import pytest
import torch

import moe_ep
import moe_ep.torch  # noqa: F401  (registers torch.ops.moe_ep)
import reference as ref

ops = torch.ops.moe_ep
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _capacity_case(n=6, h=20, e=3, c=4, dtype=torch.float32, seed=0, two_d=True,
                   index_dtype=torch.int64):
    """tokens (n, h); an (e, c) table of token ids with repeats and one token in no slot (as
    Megatron's drop-and-pad fills it); probs (e, c) fp32; 1-D table and probs when not two_d."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randn(n, h, generator=g).to(dtype)
    table = torch.randint(0, max(n - 1, 1), (e, c), generator=g).to(index_dtype)
    probs = torch.rand(e, c, generator=g)
    if not two_d:
        table, probs = table.reshape(-1), probs.reshape(-1)
    return tokens, table, probs


def _bits(a, b):
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
    assert torch.equal(a.view(torch.uint8) if a.dtype != torch.float32 else a.view(torch.int32),
                       b.view(torch.uint8) if b.dtype != torch.float32 else b.view(torch.int32))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("two_d", [True, False])
@pytest.mark.parametrize("with_probs", [True, False])
def test_ops_match_reference_bitwise(dtype, two_d, with_probs):
    tokens, table, probs = _capacity_case(dtype=dtype, two_d=two_d, seed=int(two_d))
    probs = probs if with_probs else None
    n, h, m = tokens.shape[0], tokens.shape[1], table.numel()
    permuted, si = ops.token_permute(tokens, table, None, True)
    want_p, want_si = ref.permute_padded(tokens, table)
    _bits(permuted, want_p)
    assert torch.equal(si, want_si) and si.dtype == torch.int32

    y = torch.randn(m, h).to(dtype)  # expert outputs
    out = ops.token_unpermute(y, si, probs, True, [n, h])
    _bits(out, ref.unpermute_padded(y, table, probs, n))
    out2, saved = ops._token_unpermute(y, table, probs, True, [n, h])
    _bits(out2, out)
    _bits(saved, y)

    gt = ops.token_permute_grad(tokens, y, table, si, True)
    _bits(gt, ref.unpermute_padded(y, table, None, n))
    _bits(ops.token_permute_grad_v2(y, table, n, dtype, 1, True), gt)

    grad_out = torch.randn(n, h).to(dtype)
    gp, gprobs = ops.token_unpermute_grad(y, grad_out, si, probs, True, [n, h])
    want_gp, want_gprobs = ref.unpermute_grad_padded(grad_out, table, probs, y)
    _bits(gp, want_gp)
    if with_probs:
        _bits(gprobs, want_gprobs)
        assert gprobs.shape == probs.shape
    else:
        assert gprobs.numel() == 0
    gp2, gprobs2 = ops.token_unpermute_grad_v2(grad_out, table, m, dtype, probs, True, None,
                                               y if with_probs else None)
    _bits(gp2, gp)
    if with_probs:
        _bits(gprobs2, gprobs)


def test_matches_megatron_formulas():
    """Megatron-LM's permute_with_padded_tokens / unpermute_with_padded_tokens in fp32: the same
    values up to the summation order scatter_add leaves open."""
    tokens, table, probs = _capacity_case(n=9, h=33, e=4, c=5, seed=3)
    permuted, si = ops.token_permute(tokens, table, None, True)
    assert torch.equal(permuted, tokens.index_select(0, table.view(-1)))
    y = torch.randn_like(permuted)
    combined = probs.view(-1).unsqueeze(-1) * y
    idx = table.view(-1, 1).expand(-1, y.shape[1])
    want = torch.zeros(tokens.shape).scatter_add(0, idx, combined)
    got = ops.token_unpermute(y, table, probs, True, list(tokens.shape))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert got[tokens.shape[0] - 1].abs().sum() == 0  # the token no slot holds


def _megatron_permute_with_padded_tokens(tokens, indices):
    """Megatron-LM's permute_with_padded_tokens (moe_utils.py), verbatim: the golden of SPEC
    §4.1's padded_mode."""
    permuted_tokens = tokens.index_select(dim=0, index=indices.view(-1))
    return permuted_tokens, indices


@pytest.mark.parametrize("two_d", [True, False])
def test_sorted_indices_is_megatrons_table(two_d):
    """SPEC §4.1: padded permute returns sorted_indices = indices, the (num_experts, capacity)
    table itself (int32), not its flattening; eager, fake (torch.compile) and the table's 1-D
    form alike. Every op taking sorted_indices takes it in that shape and flattened, with the
    same bits."""
    tokens, table, probs = _capacity_case(n=7, h=12, e=3, c=5, seed=11, two_d=two_d)
    n, h, m = tokens.shape[0], tokens.shape[1], table.numel()
    want_p, want_si = _megatron_permute_with_padded_tokens(tokens, table)
    permuted, si = ops.token_permute(tokens, table, None, True)
    assert si.shape == want_si.shape == ((3, 5) if two_d else (15,)), si.shape
    assert si.dtype == torch.int32
    assert torch.equal(si.long(), want_si) and torch.equal(permuted, want_p)
    compiled = torch.compile(lambda x: ops.token_permute(x, table, None, True),
                             backend="aot_eager", fullgraph=True)
    assert compiled(tokens)[1].shape == want_si.shape

    y, g = torch.randn(m, h), torch.randn(n, h)
    flat = si.reshape(-1)
    for name, call in [
        ("permute_grad", lambda s: ops.token_permute_grad(tokens, y, table, s, True)),
        ("permute_grad_v2", lambda s: ops.token_permute_grad_v2(y, s, n, torch.float32, 1, True)),
        ("unpermute", lambda s: ops.token_unpermute(y, s, probs, True, [n, h])),
        ("_unpermute", lambda s: ops._token_unpermute(y, s, probs, True, [n, h])[0]),
        ("unpermute_grad", lambda s: ops.token_unpermute_grad(y, g, s, probs, True, [n, h])),
        ("unpermute_grad_v2",
         lambda s: ops.token_unpermute_grad_v2(g, s, m, torch.float32, probs, True, None, y)),
    ]:
        a, b = call(si), call(flat)
        for x, z in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
            _bits(x, z)
    # the unpermute of permute's own outputs is Megatron's scatter_add, up to its open order
    out = ops.token_unpermute(permuted, si, probs, True, [n, h])
    idx = table.reshape(-1, 1).expand(-1, h)
    want = torch.zeros(n, h).scatter_add(0, idx, probs.reshape(-1, 1) * want_p)
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    torch.library.opcheck(ops.token_permute.default, (tokens, table, None, True))
    torch.library.opcheck(ops.token_permute_grad.default, (tokens, y, table, si, True))
    torch.library.opcheck(ops.token_unpermute_grad_v2.default,
                          (g, si, m, torch.float32, probs, True, [n, h], y))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_autograd_matches_plain_torch(dtype):
    """permute -> expert scale -> unpermute, differentiated by moe-ep's backward ops, against
    plain torch autograd of Megatron's formulas (fp32 sums; bf16 rounds the same products)."""
    tokens, table, probs = _capacity_case(n=7, h=24, e=3, c=5, seed=5)
    scale = torch.randn(tokens.shape[1])

    def layer(x, w, padded):
        if padded:
            p, si = ops.token_permute(x, table, None, True)
            return ops.token_unpermute(p * scale.to(x.dtype), si, w, True, list(x.shape))
        p = x.index_select(0, table.view(-1))
        comb = w.view(-1, 1) * (p * scale.to(x.dtype)).float()
        idx = table.view(-1, 1).expand(-1, x.shape[1])
        return torch.zeros(x.shape).scatter_add(0, idx, comb).to(x.dtype)

    grads = []
    for padded in (True, False):
        x = tokens.to(dtype).clone().requires_grad_()
        w = probs.clone().requires_grad_()
        out = layer(x, w, padded)
        (out.float() * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
        grads.append((out.detach(), x.grad, w.grad))
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for got, want in zip(grads[0], grads[1]):
        torch.testing.assert_close(got.float(), want.float(), **tol)


def test_compile_fullgraph():
    tokens, table, probs = _capacity_case(seed=8)

    def f(x, w):
        p, si = ops.token_permute(x, table, None, True)
        return ops.token_unpermute(p * 2, si, w, True, list(x.shape))

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    x, w = tokens.clone().requires_grad_(), probs.clone().requires_grad_()
    out = compiled(x, w)
    torch.testing.assert_close(out, f(tokens, probs), rtol=0, atol=0)
    out.sum().backward()
    assert x.grad is not None and w.grad is not None and w.grad.shape == probs.shape


def _opcheck_cases():
    tokens, table, probs = _capacity_case(n=5, h=8, e=2, c=3, seed=9)
    n, h, m = tokens.shape[0], tokens.shape[1], table.numel()
    y, g = torch.randn(m, h), torch.randn(n, h)
    si = table.reshape(-1).to(torch.int32)
    return [
        ("token_permute", (tokens, table, None, True)),
        ("token_permute_grad", (tokens, y, table, si, True)),
        ("token_permute_grad_v2", (y, si, n, torch.float32, 1, True)),
        ("token_unpermute", (y, si, probs, True, [n, h])),
        ("_token_unpermute", (y, si, probs, True, [n, h])),
        ("token_unpermute_grad", (y, g, si, probs, True, [n, h])),
        ("token_unpermute_grad_v2", (g, si, m, torch.float32, probs, True, [n, h], y)),
    ]


@pytest.mark.parametrize("name,args", _opcheck_cases(), ids=[c[0] for c in _opcheck_cases()])
def test_opcheck(name, args):
    torch.library.opcheck(getattr(ops, name).default, args)


def _error_calls():
    tokens, table, probs = _capacity_case(n=4, h=6, e=2, c=3, seed=10)
    y = torch.randn(table.numel(), 6)
    bad = table.clone()
    bad[1, 2] = 4
    return [
        ("permute-id", lambda: ops.token_permute(tokens, bad, None, True),
         "permute: indices[1,2] = 4 is outside [0, 4)"),
        ("permute-num_out", lambda: ops.token_permute(tokens, table, 5, True),
         "permute: num_out_tokens = 5 must be None, 0 or 6"),
        ("unpermute-restore", lambda: ops.token_unpermute(y, table, probs, True, None),
         "token_unpermute: restore_shape is missing"),
        ("unpermute-saved-restore", lambda: ops._token_unpermute(y, table, probs, True, None),
         "_token_unpermute: restore_shape is missing"),
        ("unpermute-probs", lambda: ops.token_unpermute(y, table, probs[:, :2], True, [4, 6]),
         "unpermute: probs has 4 entries, must equal 6"),
        ("unpermute-rows", lambda: ops.token_unpermute(y[:5], table, None, True, [4, 6]),
         "unpermute: permuted_tokens.shape[0] = 5 must equal 6"),
    ]


@pytest.mark.parametrize("fake", [False, True], ids=["real", "fake"])
@pytest.mark.parametrize("name,call,message", _error_calls(), ids=[c[0] for c in _error_calls()])
def test_errors_name_op_parameter_value_bound(name, call, message, fake):
    """A malformed padded call is an InvalidArgumentError naming the op and the parameter; the
    fake implementations check what shapes alone can show (restore_shape, num_out_tokens)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    shape_only = name in ("permute-num_out", "unpermute-restore", "unpermute-saved-restore")
    if fake and not shape_only:
        pytest.skip("a value check: the fake implementation sees no values")
    with pytest.raises(moe_ep.InvalidArgumentError) as info:
        if fake:
            with FakeTensorMode(allow_non_fake_inputs=True):
                call()
        else:
            call()
    assert message in str(info.value), str(info.value)
