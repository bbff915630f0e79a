"""SPEC §4 as torch custom ops: moe_ep::token_permute, token_permute_grad(_v2),
token_unpermute, _token_unpermute, token_unpermute_grad(_v2).

Each op has a real (CPU) implementation calling the C++ library through moe_ep._C, a fake
implementation giving output shapes (so torch.compile(fullgraph=True) traces it), and, for permute
and unpermute, autograd as SPEC §4.3 and torch_npu wire it: permute's backward is
token_permute_grad_v2; unpermute's backward is token_unpermute_grad_v2, which keeps
permuted_tokens only when probs are given.

Argument names and defaults are the SPEC's (and torch_npu's npu_moe_token_* ops). Dtypes: token
tensors bf16/fp16/fp32, indices int32/int64, sorted_indices int32, probs bf16/fp16/fp32; other
dtypes (fp64 included) raise moe_ep.UnsupportedError. Errors are moe_ep.Error subclasses naming
the op, the parameter, the value and the bound.

Decisions of this front (beyond SPEC §4):
- token_unpermute_grad(_v2) without probs returns grad_probs as an empty (0,) tensor of
  grad_out's dtype: a custom op cannot return None.
- restore_shape (N, H) is optional without padded_mode (its N is then checked) and required by
  token_unpermute with it (its N gives the output rows). Its hidden size is not checked here,
  because under a DTensor Shard(1) strategy every shard sees the global restore_shape.
- padded_mode=True is Megatron-LM's capacity layout (SPEC §4.1, include/moe_ep/permute.h):
  indices is a table of token ids, one per slot, 1-D or 2-D (num_experts, capacity); permute
  gathers the slots' rows and returns the table itself, in its shape (int32), as sorted_indices
  (Megatron-LM's permute_with_padded_tokens returns sorted_indices = indices); the other ops
  take that table (or the caller's own, or the same entries flattened: int32/int64, 1-D or
  2-D), probs with one weight per slot, and give grad_probs in probs' shape. Ascend's torch_npu
  kernel has no padded mode.
- The public functions below are plain functions over the custom ops (torch.ops.moe_ep.*): they
  check every argument's type first (moe_ep.InvalidArgumentError naming op, parameter, value and
  expected type: None or a list for a tensor, a bool for an int, ...), which the torch dispatcher
  does not. The real implementations repeat those checks and refuse, before allocating, an output,
  an input (an expanded tensor) or their sum beyond this machine's physical memory (at most 2^62
  bytes; _args.py).
"""

from __future__ import annotations

import functools
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from moe_ep import InvalidArgumentError, _C
from moe_ep.torch import _args
from moe_ep.torch._convert import dl, dtype_name, tt

# ---------------------------------------------------------------------------------------------
# Shape rules shared by the real and the fake implementations.


def _ndim(op: str, name: str, t: Optional[Tensor], *ndims: int) -> None:
    """The fake implementations' rank checks, with the C++ op's name and message (a malformed
    input under torch.compile raises InvalidArgumentError at trace time, not IndexError)."""
    if t is not None and t.dim() not in ndims:
        want = " or ".join(str(n) for n in ndims)
        raise InvalidArgumentError(f"{op}: {name}.ndim = {t.dim()} must be {want}")


def _topk(indices: Tensor) -> int:
    return 1 if indices.dim() == 1 else indices.shape[1]


def _permute_rows(op: str, m: int, num_out_tokens: Optional[int]) -> int:
    n = num_out_tokens or 0
    if n > 0:
        return min(n, m)
    if n < -m:
        raise InvalidArgumentError(
            f"{op}: num_out_tokens = {n} drops more than the M = {m} rows there are"
        )
    return m + n


def _unpermute_ndims(op: str, permuted_tokens, sorted_indices, probs, padded_mode) -> None:
    _ndim(op, "permuted_tokens", permuted_tokens, 2)
    # padded_mode: a table of token ids and one weight per slot, 1-D or 2-D alike
    _ndim(op, "sorted_indices", sorted_indices, *((1, 2) if padded_mode else (1,)))
    _ndim(op, "probs", probs, *((1, 2) if padded_mode else (2,)))


def _unpermute_rows(op: str, sorted_indices: Tensor, probs: Optional[Tensor], padded_mode: bool,
                    restore_shape: Optional[List[int]]) -> int:
    """N: probs' rows, or M without probs (no reduction); restore_shape[0] in padded mode, where
    restore_shape is required."""
    if padded_mode:
        if restore_shape is None:
            raise InvalidArgumentError(
                f"{op}: restore_shape is missing; padded_mode needs it (its [0] is N, the "
                "output rows)")
        if len(restore_shape) != 2 or restore_shape[0] < 0:
            raise InvalidArgumentError(
                f"{op}: restore_shape = {list(restore_shape)} must be [N, H] with N >= 0")
        return restore_shape[0]
    return probs.shape[0] if probs is not None else sorted_indices.shape[0]


def _padded_permute_rows(op: str, indices: Tensor, num_out_tokens: Optional[int]) -> int:
    """padded_mode keeps every slot: M = the entries of the table; num_out_tokens may only say
    so."""
    m = indices.numel()
    if num_out_tokens not in (None, 0, m):
        raise InvalidArgumentError(
            f"{op}: num_out_tokens = {num_out_tokens} must be None, 0 or {m} (the entries of "
            "indices; padded_mode keeps every slot)")
    return m


def _check_restore_shape(op: str, restore_shape: Optional[List[int]], rows: int) -> None:
    if restore_shape is None:
        return
    if len(restore_shape) != 2:
        raise InvalidArgumentError(
            f"{op}: restore_shape = {list(restore_shape)} has {len(restore_shape)} entries, "
            "expected 2 (N, H)"
        )
    if restore_shape[0] != rows:
        raise InvalidArgumentError(
            f"{op}: restore_shape[0] = {restore_shape[0]} is not the number of output rows "
            f"N = {rows}"
        )


def _restore_for_c(op: str, permuted_tokens: Tensor, sorted_indices: Tensor,
                   probs: Optional[Tensor], padded_mode: bool,
                   restore_shape: Optional[List[int]]) -> Optional[List[int]]:
    """Checks restore_shape's N and gives the C++ op what it needs: nothing without padded_mode
    (the output rows come from the other inputs), [N, local H] with it (a Shard(1) piece's H is
    not restore_shape's global one)."""
    rows = _unpermute_rows(op, sorted_indices, probs, padded_mode, restore_shape)
    if not padded_mode:
        _check_restore_shape(op, restore_shape, rows)
        return None
    return [rows, permuted_tokens.shape[1]]


def _unpermute_out_bytes(op: str, permuted_tokens: Tensor, sorted_indices: Tensor,
                         probs: Optional[Tensor], padded_mode: bool,
                         restore_shape: Optional[List[int]]) -> int:
    """unpermute's output (N, H) within the bound, N as the C++ op takes it; its bytes."""
    if padded_mode and restore_shape is not None and len(restore_shape) == 2:
        rows = restore_shape[0]
    elif probs is not None:
        rows = probs.shape[0] if probs.dim() else 0
    else:
        rows = sorted_indices.numel()
    return _args.out_bytes(op, "out (N, H)", (rows, _h(permuted_tokens)), permuted_tokens.dtype)


def _grad_probs_bytes(probs: Optional[Tensor]) -> int:
    return 0 if probs is None else probs.numel() * probs.element_size()


def _empty_grad_probs(like: Tensor) -> Tensor:
    return like.new_empty((0,))


def _inputs(op: str, made: int = 0, **tensors: Optional[Tensor]):
    """The tensors as moe_ep._C inputs (dl), in argument order; a dtype the binding cannot take
    (fp64, ...) raises moe_ep.UnsupportedError naming op and parameter; a tensor describing more
    bytes than _args.out_bytes_bound() (an expanded one), or together with the bytes the op makes
    (made: outputs and scratch) more than it, InvalidArgumentError."""
    for name, t in tensors.items():
        _args.in_bytes(op, name, t)
    _args.working_set(op, tensors, made)
    return tuple(dl(t, op, name) for name, t in tensors.items())


def _h(t: Optional[Tensor]) -> int:
    """The hidden size an output takes from t: its last dim (0 for a rank below 2, which the C++
    checks refuse)."""
    return t.shape[-1] if t is not None and t.dim() >= 2 else 0


# ---------------------------------------------------------------------------------------------
# permute


@torch.library.custom_op("moe_ep::token_permute", mutates_args=())
def _op_token_permute(
    tokens: Tensor,
    indices: Tensor,
    num_out_tokens: Optional[int] = None,
    padded_mode: bool = False,
) -> Tuple[Tensor, Tensor]:
    """SPEC §4.1. tokens (N, H); indices (N,) or (N, topK) int32/int64.
    Returns (permuted_tokens (rows, H), sorted_indices (N*topK,) int32). padded_mode: indices
    is a table of token ids (one per slot); permuted_tokens has a row per slot and
    sorted_indices is the table, int32, in indices' shape ((num_experts, capacity) or (M,))."""
    _check_permute(tokens, indices, num_out_tokens, padded_mode)
    m = indices.numel()
    rows = m if padded_mode or not num_out_tokens or num_out_tokens < 0 else min(num_out_tokens, m)
    made = _args.out_bytes("token_permute", "permuted_tokens (rows, H)", (rows, _h(tokens)),
                           tokens.dtype)
    made += 12 * m  # sorted_indices (int32), and the sort's keys and order (int32 each)
    tokens, indices = _inputs("token_permute", made, tokens=tokens, indices=indices)
    p, s = _C.token_permute(tokens, indices, num_out_tokens, padded_mode)
    return tt(p), tt(s)


@_op_token_permute.register_fake
def _(tokens, indices, num_out_tokens=None, padded_mode=False):
    _ndim("permute", "tokens", tokens, 2)
    _ndim("permute", "indices", indices, 1, 2)
    m = indices.numel()
    if padded_mode:
        rows = _padded_permute_rows("permute", indices, num_out_tokens)
    else:
        rows = _permute_rows("token_permute", m, num_out_tokens)
    # padded_mode: sorted_indices = indices (SPEC §4.1), in its shape
    si_shape = tuple(indices.shape) if padded_mode else (m,)
    return (tokens.new_empty((rows, tokens.shape[1])),
            indices.new_empty(si_shape, dtype=torch.int32))


def _permute_setup(ctx, inputs, output):
    tokens, indices, _, padded_mode = inputs
    ctx.tokens_rows = tokens.shape[0]
    ctx.tokens_dtype = tokens.dtype
    ctx.num_topk = 1 if padded_mode else _topk(indices)  # unused in padded mode
    ctx.padded_mode = padded_mode
    ctx.save_for_backward(output[1])


def _permute_backward(ctx, grad_permuted, grad_sorted_indices):
    if grad_permuted is None or not ctx.needs_input_grad[0]:
        return None, None, None, None
    (sorted_indices,) = ctx.saved_tensors
    grad_tokens = _op_token_permute_grad_v2(
        grad_permuted,
        sorted_indices,
        ctx.tokens_rows,
        ctx.tokens_dtype,
        ctx.num_topk,
        ctx.padded_mode,
    )
    return grad_tokens, None, None, None


_op_token_permute.register_autograd(_permute_backward, setup_context=_permute_setup)


@torch.library.custom_op("moe_ep::token_permute_grad", mutates_args=())
def _op_token_permute_grad(
    tokens: Tensor,
    grad_permuted_tokens: Tensor,
    indices: Tensor,
    sorted_indices: Tensor,
    padded_mode: bool = False,
) -> Tensor:
    """SPEC §4.3. Returns grad_tokens (N, H) in tokens' dtype (only tokens' shape and dtype are
    used)."""
    _check_permute_grad(tokens, grad_permuted_tokens, indices, sorted_indices, padded_mode)
    made = _args.out_bytes("token_permute_grad", "grad_tokens (N, H)",
                           (tokens.shape[0] if tokens.dim() else 0, _h(grad_permuted_tokens)),
                           tokens.dtype)
    args = _inputs(
        "token_permute_grad",
        made,
        tokens=tokens,
        grad_permuted_tokens=grad_permuted_tokens,
        indices=indices,
        sorted_indices=sorted_indices,
    )
    return tt(_C.token_permute_grad(*args, padded_mode))


@_op_token_permute_grad.register_fake
def _(tokens, grad_permuted_tokens, indices, sorted_indices, padded_mode=False):
    _ndim("permute_grad", "tokens", tokens, 2)
    _ndim("permute_grad", "grad_permuted_tokens", grad_permuted_tokens, 2)
    return tokens.new_empty((tokens.shape[0], grad_permuted_tokens.shape[1]))


@torch.library.custom_op("moe_ep::token_permute_grad_v2", mutates_args=())
def _op_token_permute_grad_v2(
    grad_permuted_tokens: Tensor,
    sorted_indices: Tensor,
    tokens_rows: int,
    tokens_dtype: torch.dtype,
    num_topk: int,
    padded_mode: bool = False,
) -> Tensor:
    """SPEC §4.3 with sizes instead of tensors. Returns grad_tokens (tokens_rows, H) in
    tokens_dtype."""
    _check_permute_grad_v2(grad_permuted_tokens, sorted_indices, tokens_rows, tokens_dtype,
                           num_topk, padded_mode)
    name = dtype_name("token_permute_grad_v2", "tokens_dtype", tokens_dtype)
    made = _args.out_bytes("token_permute_grad_v2", "grad_tokens (tokens_rows, H)",
                           (tokens_rows, _h(grad_permuted_tokens)), tokens_dtype)
    grad, si = _inputs(
        "token_permute_grad_v2",
        made,
        grad_permuted_tokens=grad_permuted_tokens,
        sorted_indices=sorted_indices,
    )
    return tt(_C.token_permute_grad_v2(grad, si, tokens_rows, name, num_topk, padded_mode))


@_op_token_permute_grad_v2.register_fake
def _(grad_permuted_tokens, sorted_indices, tokens_rows, tokens_dtype, num_topk, padded_mode=False):
    _ndim("permute_grad_v2", "grad_permuted_tokens", grad_permuted_tokens, 2)
    return grad_permuted_tokens.new_empty(
        (tokens_rows, grad_permuted_tokens.shape[1]), dtype=tokens_dtype
    )


# ---------------------------------------------------------------------------------------------
# unpermute


@torch.library.custom_op("moe_ep::token_unpermute", mutates_args=())
def _op_token_unpermute(
    permuted_tokens: Tensor,
    sorted_indices: Tensor,
    probs: Optional[Tensor] = None,
    padded_mode: bool = False,
    restore_shape: Optional[List[int]] = None,
) -> Tensor:
    """SPEC §4.2. permuted_tokens (P, H); sorted_indices (M,) int32; probs (N, topK) or None.
    Returns out (N, H) (N = M without probs; restore_shape[0] in padded mode) in
    permuted_tokens' dtype."""
    _check_unpermute("token_unpermute", permuted_tokens, sorted_indices, probs, padded_mode,
                     restore_shape)
    made = _unpermute_out_bytes("token_unpermute", permuted_tokens, sorted_indices, probs,
                                padded_mode, restore_shape)
    args = _inputs(
        "token_unpermute",
        made,
        permuted_tokens=permuted_tokens,
        sorted_indices=sorted_indices,
        probs=probs,
    )
    restore = _restore_for_c("token_unpermute", permuted_tokens, sorted_indices, probs,
                             padded_mode, restore_shape)
    return tt(_C.token_unpermute(*args, padded_mode, restore))


@_op_token_unpermute.register_fake
def _(permuted_tokens, sorted_indices, probs=None, padded_mode=False, restore_shape=None):
    _unpermute_ndims("unpermute", permuted_tokens, sorted_indices, probs, padded_mode)
    rows = _unpermute_rows("token_unpermute", sorted_indices, probs, padded_mode, restore_shape)
    return permuted_tokens.new_empty((rows, permuted_tokens.shape[1]))


@torch.library.custom_op("moe_ep::_token_unpermute", mutates_args=())
def _op__token_unpermute(
    permuted_tokens: Tensor,
    sorted_indices: Tensor,
    probs: Optional[Tensor] = None,
    padded_mode: bool = False,
    restore_shape: Optional[List[int]] = None,
) -> Tuple[Tensor, Tensor]:
    """torch_npu's _npu_moe_token_unpermute: token_unpermute plus a copy of permuted_tokens kept
    for the backward. Returns (out (N, H), permuted_tokens_for_backward (P, H))."""
    _check_unpermute("_token_unpermute", permuted_tokens, sorted_indices, probs, padded_mode,
                     restore_shape)
    made = _unpermute_out_bytes("_token_unpermute", permuted_tokens, sorted_indices, probs,
                                padded_mode, restore_shape)
    args = _inputs(
        "_token_unpermute",
        made + permuted_tokens.numel() * permuted_tokens.element_size(),  # and the saved copy
        permuted_tokens=permuted_tokens,
        sorted_indices=sorted_indices,
        probs=probs,
    )
    restore = _restore_for_c("_token_unpermute", permuted_tokens, sorted_indices, probs,
                             padded_mode, restore_shape)
    out, saved = _C.token_unpermute_with_saved(*args, padded_mode, restore)
    return tt(out), tt(saved)


@_op__token_unpermute.register_fake
def _(permuted_tokens, sorted_indices, probs=None, padded_mode=False, restore_shape=None):
    _unpermute_ndims("unpermute_with_saved", permuted_tokens, sorted_indices, probs, padded_mode)
    rows = _unpermute_rows("_token_unpermute", sorted_indices, probs, padded_mode, restore_shape)
    return (
        permuted_tokens.new_empty((rows, permuted_tokens.shape[1])),
        permuted_tokens.new_empty(permuted_tokens.shape),
    )


def _unpermute_setup_common(ctx, inputs, permuted_for_backward):
    permuted_tokens, sorted_indices, probs, padded_mode, restore_shape = inputs
    ctx.permuted_rows = permuted_tokens.shape[0]
    ctx.permuted_dtype = permuted_tokens.dtype
    ctx.padded_mode = padded_mode
    ctx.restore_shape = restore_shape
    ctx.has_probs = probs is not None
    # SPEC §4.3: the activations are needed only for grad_probs.
    if probs is not None:
        ctx.save_for_backward(sorted_indices, probs, permuted_for_backward)
    else:
        ctx.save_for_backward(sorted_indices)


def _unpermute_setup(ctx, inputs, output):
    _unpermute_setup_common(ctx, inputs, inputs[0])


def _unpermute_with_saved_setup(ctx, inputs, output):
    _unpermute_setup_common(ctx, inputs, output[1])
    # An unused output's gradient arrives as None, not as zeros: adding +0 would turn the -0
    # entries of grad_permuted_tokens into +0.
    ctx.set_materialize_grads(False)


def _unpermute_backward(ctx, grad_out, grad_saved=None):
    """token_unpermute's backward (SPEC §4.3) is token_unpermute_grad_v2. For _token_unpermute,
    whose second output is a copy of permuted_tokens, a gradient flowing into that copy is added
    to grad_permuted_tokens."""
    grad_permuted = grad_probs = None
    if grad_out is not None:
        if ctx.has_probs:
            sorted_indices, probs, permuted = ctx.saved_tensors
        else:
            (sorted_indices,) = ctx.saved_tensors
            probs = permuted = None
        grad_permuted, grad_probs = _op_token_unpermute_grad_v2(
            grad_out,
            sorted_indices,
            ctx.permuted_rows,
            ctx.permuted_dtype,
            probs,
            ctx.padded_mode,
            ctx.restore_shape,
            permuted,
        )
    if grad_saved is not None:
        grad_permuted = grad_saved if grad_permuted is None else grad_permuted + grad_saved
    want_permuted = ctx.needs_input_grad[0]
    want_probs = ctx.has_probs and ctx.needs_input_grad[2]
    return (
        grad_permuted if want_permuted else None,
        None,
        grad_probs if want_probs else None,
        None,
        None,
    )


_op_token_unpermute.register_autograd(_unpermute_backward, setup_context=_unpermute_setup)
_op__token_unpermute.register_autograd(
    _unpermute_backward, setup_context=_unpermute_with_saved_setup
)


@torch.library.custom_op("moe_ep::token_unpermute_grad", mutates_args=())
def _op_token_unpermute_grad(
    permuted_tokens: Tensor,
    grad_out: Tensor,
    sorted_indices: Tensor,
    probs: Optional[Tensor] = None,
    padded_mode: bool = False,
    restore_shape: Optional[List[int]] = None,
) -> Tuple[Tensor, Tensor]:
    """SPEC §4.3. Returns (grad_permuted_tokens (P, H), grad_probs (N, topK) in probs' dtype, or
    an empty (0,) tensor without probs)."""
    _check_unpermute_grad(permuted_tokens, grad_out, sorted_indices, probs, padded_mode,
                          restore_shape)
    _check_restore_shape("token_unpermute_grad", restore_shape, grad_out.shape[0])
    made = _args.out_bytes("token_unpermute_grad", "grad_permuted_tokens (P, H)",
                           (permuted_tokens.shape[0] if permuted_tokens.dim() else 0,
                            _h(grad_out)), grad_out.dtype)
    args = _inputs(
        "token_unpermute_grad",
        made + _grad_probs_bytes(probs),
        permuted_tokens=permuted_tokens,
        grad_out=grad_out,
        sorted_indices=sorted_indices,
        probs=probs,
    )
    gp, gprobs = _C.token_unpermute_grad(*args, padded_mode)
    return tt(gp), tt(gprobs) if gprobs is not None else _empty_grad_probs(grad_out)


@_op_token_unpermute_grad.register_fake
def _(permuted_tokens, grad_out, sorted_indices, probs=None, padded_mode=False, restore_shape=None):
    _unpermute_ndims("unpermute_grad", permuted_tokens, sorted_indices, probs, padded_mode)
    _ndim("unpermute_grad", "grad_out", grad_out, 2)
    gp = grad_out.new_empty((permuted_tokens.shape[0], grad_out.shape[1]))
    return gp, probs.new_empty(probs.shape) if probs is not None else _empty_grad_probs(grad_out)


@torch.library.custom_op("moe_ep::token_unpermute_grad_v2", mutates_args=())
def _op_token_unpermute_grad_v2(
    grad_out: Tensor,
    sorted_indices: Tensor,
    permuted_rows: int,
    permuted_dtype: torch.dtype,
    probs: Optional[Tensor] = None,
    padded_mode: bool = False,
    restore_shape: Optional[List[int]] = None,
    permuted_tokens: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """SPEC §4.3 with sizes instead of tensors; permuted_tokens is required only with probs.
    Returns as token_unpermute_grad."""
    _check_unpermute_grad_v2(grad_out, sorted_indices, permuted_rows, permuted_dtype, probs,
                             padded_mode, restore_shape, permuted_tokens)
    _check_restore_shape("token_unpermute_grad_v2", restore_shape, grad_out.shape[0])
    name = dtype_name("token_unpermute_grad_v2", "permuted_dtype", permuted_dtype)
    made = _args.out_bytes("token_unpermute_grad_v2",
                           "grad_permuted_tokens (permuted_rows, H)",
                           (permuted_rows, _h(grad_out)), permuted_dtype)
    g, si, pr, x = _inputs(
        "token_unpermute_grad_v2",
        made + _grad_probs_bytes(probs),
        grad_out=grad_out,
        sorted_indices=sorted_indices,
        probs=probs,
        permuted_tokens=permuted_tokens,
    )
    gp, gprobs = _C.token_unpermute_grad_v2(g, si, permuted_rows, name, pr, padded_mode, None, x)
    return tt(gp), tt(gprobs) if gprobs is not None else _empty_grad_probs(grad_out)


@_op_token_unpermute_grad_v2.register_fake
def _(
    grad_out,
    sorted_indices,
    permuted_rows,
    permuted_dtype,
    probs=None,
    padded_mode=False,
    restore_shape=None,
    permuted_tokens=None,
):
    _unpermute_ndims("unpermute_grad_v2", permuted_tokens, sorted_indices, probs, padded_mode)
    _ndim("unpermute_grad_v2", "grad_out", grad_out, 2)
    gp = grad_out.new_empty((permuted_rows, grad_out.shape[1]), dtype=permuted_dtype)
    return gp, probs.new_empty(probs.shape) if probs is not None else _empty_grad_probs(grad_out)


# ---------------------------------------------------------------------------------------------
# The public functions: each checks its arguments' types (_args: a moe_ep.InvalidArgumentError
# naming the op, the parameter, the value and the expected type, where the torch dispatcher would
# pass None on, take True as 1 or raise its own RuntimeError), then calls the custom op. The
# checks are plain isinstance tests, so torch.compile traces them; the real implementations
# repeat them (torch.ops.moe_ep.* called directly) and refuse outputs beyond the size bound.

_T, _OPT_T = _args.tensor, functools.partial(_args.tensor, optional=True)
_INT, _OPT_INT = _args.integer, functools.partial(_args.integer, optional=True)
_BOOL, _DTYPE = _args.boolean, _args.dtype
_OPT_SHAPE = functools.partial(_args.int_list, optional=True)


def _check(op: str, *checks) -> None:
    for name, value, kind in checks:
        kind(op, name, value)


def _check_permute(tokens, indices, num_out_tokens, padded_mode) -> None:
    _check("token_permute", ("tokens", tokens, _T), ("indices", indices, _T),
           ("num_out_tokens", num_out_tokens, _OPT_INT), ("padded_mode", padded_mode, _BOOL))


def _check_permute_grad(tokens, grad_permuted_tokens, indices, sorted_indices, padded_mode):
    _check("token_permute_grad", ("tokens", tokens, _T),
           ("grad_permuted_tokens", grad_permuted_tokens, _T), ("indices", indices, _T),
           ("sorted_indices", sorted_indices, _T), ("padded_mode", padded_mode, _BOOL))


def _check_permute_grad_v2(grad_permuted_tokens, sorted_indices, tokens_rows, tokens_dtype,
                           num_topk, padded_mode) -> None:
    _check("token_permute_grad_v2", ("grad_permuted_tokens", grad_permuted_tokens, _T),
           ("sorted_indices", sorted_indices, _T), ("tokens_rows", tokens_rows, _INT),
           ("tokens_dtype", tokens_dtype, _DTYPE), ("num_topk", num_topk, _INT),
           ("padded_mode", padded_mode, _BOOL))


def _check_unpermute(op, permuted_tokens, sorted_indices, probs, padded_mode, restore_shape):
    _check(op, ("permuted_tokens", permuted_tokens, _T), ("sorted_indices", sorted_indices, _T),
           ("probs", probs, _OPT_T), ("padded_mode", padded_mode, _BOOL),
           ("restore_shape", restore_shape, _OPT_SHAPE))


def _check_unpermute_grad(permuted_tokens, grad_out, sorted_indices, probs, padded_mode,
                          restore_shape) -> None:
    _check("token_unpermute_grad", ("permuted_tokens", permuted_tokens, _T),
           ("grad_out", grad_out, _T), ("sorted_indices", sorted_indices, _T),
           ("probs", probs, _OPT_T), ("padded_mode", padded_mode, _BOOL),
           ("restore_shape", restore_shape, _OPT_SHAPE))


def _check_unpermute_grad_v2(grad_out, sorted_indices, permuted_rows, permuted_dtype, probs,
                             padded_mode, restore_shape, permuted_tokens) -> None:
    _check("token_unpermute_grad_v2", ("grad_out", grad_out, _T),
           ("sorted_indices", sorted_indices, _T), ("permuted_rows", permuted_rows, _INT),
           ("permuted_dtype", permuted_dtype, _DTYPE), ("probs", probs, _OPT_T),
           ("padded_mode", padded_mode, _BOOL), ("restore_shape", restore_shape, _OPT_SHAPE),
           ("permuted_tokens", permuted_tokens, _OPT_T))


def token_permute(
    tokens: Tensor,
    indices: Tensor,
    num_out_tokens: Optional[int] = None,
    padded_mode: bool = False,
) -> Tuple[Tensor, Tensor]:
    """SPEC §4.1 (torch.ops.moe_ep.token_permute). tokens (N, H); indices (N,) or (N, topK)
    int32/int64. Returns (permuted_tokens (rows, H), sorted_indices (N*topK,) int32).
    padded_mode: indices is a table of token ids (one per slot); permuted_tokens has a row per
    slot and sorted_indices is the table, int32, in indices' shape ((num_experts, capacity) for
    a 2-D table, as Megatron-LM's). Differentiable in tokens."""
    _check_permute(tokens, indices, num_out_tokens, padded_mode)
    return _op_token_permute(tokens, indices, num_out_tokens, padded_mode)


def token_permute_grad(
    tokens: Tensor,
    grad_permuted_tokens: Tensor,
    indices: Tensor,
    sorted_indices: Tensor,
    padded_mode: bool = False,
) -> Tensor:
    """SPEC §4.3 (torch.ops.moe_ep.token_permute_grad). Returns grad_tokens (N, H) in tokens'
    dtype (only tokens' shape and dtype are used)."""
    _check_permute_grad(tokens, grad_permuted_tokens, indices, sorted_indices, padded_mode)
    return _op_token_permute_grad(tokens, grad_permuted_tokens, indices, sorted_indices,
                                  padded_mode)


def token_permute_grad_v2(
    grad_permuted_tokens: Tensor,
    sorted_indices: Tensor,
    tokens_rows: int,
    tokens_dtype: torch.dtype,
    num_topk: int,
    padded_mode: bool = False,
) -> Tensor:
    """SPEC §4.3 with sizes instead of tensors (torch.ops.moe_ep.token_permute_grad_v2).
    Returns grad_tokens (tokens_rows, H) in tokens_dtype."""
    _check_permute_grad_v2(grad_permuted_tokens, sorted_indices, tokens_rows, tokens_dtype,
                           num_topk, padded_mode)
    return _op_token_permute_grad_v2(grad_permuted_tokens, sorted_indices, tokens_rows,
                                     tokens_dtype, num_topk, padded_mode)


def token_unpermute(
    permuted_tokens: Tensor,
    sorted_indices: Tensor,
    probs: Optional[Tensor] = None,
    padded_mode: bool = False,
    restore_shape: Optional[List[int]] = None,
) -> Tensor:
    """SPEC §4.2 (torch.ops.moe_ep.token_unpermute). permuted_tokens (P, H); sorted_indices (M,)
    int32; probs (N, topK) or None. Returns out (N, H) (N = M without probs; restore_shape[0] in
    padded mode) in permuted_tokens' dtype. Differentiable in permuted_tokens and probs."""
    _check_unpermute("token_unpermute", permuted_tokens, sorted_indices, probs, padded_mode,
                     restore_shape)
    return _op_token_unpermute(permuted_tokens, sorted_indices, probs, padded_mode, restore_shape)


def _token_unpermute(
    permuted_tokens: Tensor,
    sorted_indices: Tensor,
    probs: Optional[Tensor] = None,
    padded_mode: bool = False,
    restore_shape: Optional[List[int]] = None,
) -> Tuple[Tensor, Tensor]:
    """torch_npu's _npu_moe_token_unpermute (torch.ops.moe_ep._token_unpermute): token_unpermute
    plus a copy of permuted_tokens kept for the backward. Returns (out (N, H),
    permuted_tokens_for_backward (P, H))."""
    _check_unpermute("_token_unpermute", permuted_tokens, sorted_indices, probs, padded_mode,
                     restore_shape)
    return _op__token_unpermute(permuted_tokens, sorted_indices, probs, padded_mode,
                                restore_shape)


def token_unpermute_grad(
    permuted_tokens: Tensor,
    grad_out: Tensor,
    sorted_indices: Tensor,
    probs: Optional[Tensor] = None,
    padded_mode: bool = False,
    restore_shape: Optional[List[int]] = None,
) -> Tuple[Tensor, Tensor]:
    """SPEC §4.3 (torch.ops.moe_ep.token_unpermute_grad). Returns (grad_permuted_tokens (P, H),
    grad_probs (N, topK) in probs' dtype, or an empty (0,) tensor without probs)."""
    _check_unpermute_grad(permuted_tokens, grad_out, sorted_indices, probs, padded_mode,
                          restore_shape)
    return _op_token_unpermute_grad(permuted_tokens, grad_out, sorted_indices, probs, padded_mode,
                                    restore_shape)


def token_unpermute_grad_v2(
    grad_out: Tensor,
    sorted_indices: Tensor,
    permuted_rows: int,
    permuted_dtype: torch.dtype,
    probs: Optional[Tensor] = None,
    padded_mode: bool = False,
    restore_shape: Optional[List[int]] = None,
    permuted_tokens: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """SPEC §4.3 with sizes instead of tensors (torch.ops.moe_ep.token_unpermute_grad_v2);
    permuted_tokens is required only with probs. Returns as token_unpermute_grad."""
    _check_unpermute_grad_v2(grad_out, sorted_indices, permuted_rows, permuted_dtype, probs,
                             padded_mode, restore_shape, permuted_tokens)
    return _op_token_unpermute_grad_v2(grad_out, sorted_indices, permuted_rows, permuted_dtype,
                                       probs, padded_mode, restore_shape, permuted_tokens)
