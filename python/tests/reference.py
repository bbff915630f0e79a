"""Pure-torch reference of SPEC §4 (token permute / unpermute and their gradients): the oracle of
test_ops.py and test_compile.py. Independent of moe_ep; written for clarity, never optimised.

Megatron-LM's formulas (megatron/core/transformer/moe/moe_utils.py, permute / unpermute), with
two differences that SPEC §4 makes:
- sorted_indices is the *inverse* of Megatron's: sorted_indices[j] is the row of permuted_tokens
  that holds entry j (j = token * topK + k), int32.
- Every reduction has a fixed order, so results are exact: fp32 accumulation in k order, each
  product rounded to fp32 before it is added (no FMA), the first present term starting the sum
  (the empty sum is +0), one rounding to the output dtype. The grad_probs dot products use the
  blocked order moe-ep fixes for them (include/moe_ep/permute.h; SPEC §4.3 asks only for fp32):
  16 partial sums from +0, lane l adding the products of h = l, l+16, ... in increasing h, then
  lane[l] += lane[l + w] for l < w, w = 8, 4, 2, 1; the result is lane 0.
  The reference loops over k (and over blocks of 16 along h) explicitly, so each torch op below
  is one elementwise IEEE operation whose rounding does not depend on how torch vectorises it.

The forward functions are differentiable torch code (gather, multiply, add), so autograd through
them gives an independent gradient oracle; with fp64 inputs they accumulate in fp64.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for bf16/fp16/fp32 (SPEC §4), fp64 for fp64 (autograd oracle only)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class _RunningSum:
    """SPEC §4's reduction: `total` is +0 until the first present term, which replaces it; each
    later present term is added (one IEEE add, in the accumulation dtype)."""

    def __init__(self, shape, dtype: torch.dtype):
        self.total = torch.zeros(shape, dtype=dtype)
        self.started = torch.zeros(shape, dtype=torch.bool)

    def add(self, term: Tensor, present: Tensor) -> None:
        present = present.expand_as(term)
        new = torch.where(self.started, self.total + term, term)
        self.total = torch.where(present, new, self.total)
        self.started = self.started | present


def num_rows(m: int, num_out_tokens: Optional[int]) -> int:
    """SPEC §4.1: rows = n > 0 ? min(n, M) : M + n (None or 0 keeps all)."""
    n = num_out_tokens or 0
    if n > 0:
        return min(n, m)
    assert n >= -m, "num_out_tokens below -M is an error, not a reference case"
    return m + n


def topk_of(indices: Tensor) -> int:
    return 1 if indices.dim() == 1 else indices.shape[1]


def permute(
    tokens: Tensor, indices: Tensor, num_out_tokens: Optional[int] = None
) -> Tuple[Tensor, Tensor]:
    """SPEC §4.1. Returns (permuted_tokens (rows, H), sorted_indices (M,) int32)."""
    topk = topk_of(indices)
    flat = indices.reshape(-1).to(torch.int64)  # entry j = token * topK + k
    m = flat.numel()
    # Megatron: sorted_indices = argsort(flat, stable=True); permuted = tokens[sorted // topK].
    order = torch.argsort(flat, stable=True)
    rows = num_rows(m, num_out_tokens)
    permuted = tokens[order[:rows] // topk]  # the tail (highest expert ids) is dropped
    sorted_indices = torch.empty(m, dtype=torch.int32)
    sorted_indices[order] = torch.arange(m, dtype=torch.int32)  # the inverse permutation
    return permuted, sorted_indices


def unpermute(
    permuted_tokens: Tensor, sorted_indices: Tensor, probs: Optional[Tensor] = None
) -> Tensor:
    """SPEC §4.2. out (N, H) in permuted_tokens' dtype; without probs N = M and topK = 1."""
    p, h = permuted_tokens.shape
    s = sorted_indices.to(torch.int64)
    m = s.numel()
    if probs is None:  # a gather, no arithmetic; dropped entries (S >= P) give 0 rows
        present = (s < p)[:, None]
        rows = permuted_tokens[s.clamp(max=max(p - 1, 0))] if p > 0 else None
        if rows is None:
            return permuted_tokens.new_zeros((m, h))
        return torch.where(present, rows, torch.zeros_like(rows))
    n, topk = probs.shape
    assert n * topk == m
    acc_dtype = _acc_dtype(permuted_tokens.dtype)
    s = s.view(n, topk)
    x = permuted_tokens.to(acc_dtype)
    w = probs.to(acc_dtype)
    total = _RunningSum((n, h), acc_dtype)
    for k in range(topk):  # SPEC: k order
        present = (s[:, k] < p)[:, None]
        if p > 0:
            rows = x[s[:, k].clamp(max=p - 1)]
        else:
            rows = x.new_zeros((n, h))
        total.add(w[:, k : k + 1] * rows, present)  # product rounded to acc_dtype, then added
    return total.total.to(permuted_tokens.dtype)


def permute_grad(
    grad_permuted: Tensor,
    sorted_indices: Tensor,
    tokens_rows: int,
    num_topk: int,
    tokens_dtype: torch.dtype,
) -> Tensor:
    """SPEC §4.3: grad_tokens[i] = sum_{k, S[i*topK+k] < R} grad_permuted[S[i*topK+k]] (fp32, k
    order), R = grad_permuted.shape[0]."""
    r, h = grad_permuted.shape
    s = sorted_indices.to(torch.int64).view(tokens_rows, num_topk)
    g = grad_permuted.to(_acc_dtype(grad_permuted.dtype))
    total = _RunningSum((tokens_rows, h), g.dtype)
    for k in range(num_topk):
        present = (s[:, k] < r)[:, None]
        rows = g[s[:, k].clamp(max=r - 1)] if r > 0 else g.new_zeros((tokens_rows, h))
        total.add(rows, present)
    return total.total.to(tokens_dtype)


def unpermute_grad(
    grad_out: Tensor,
    sorted_indices: Tensor,
    permuted_rows: int,
    permuted_dtype: torch.dtype,
    probs: Optional[Tensor] = None,
    permuted_tokens: Optional[Tensor] = None,
) -> Tuple[Tensor, Optional[Tensor]]:
    """SPEC §4.3. Returns (grad_permuted (P, H) in permuted_dtype, grad_probs (N, topK) in probs'
    dtype or None without probs).
    - grad_permuted[S[j]] = grad_out[j / topK] * probs[j / topK, j % topK] (fp32 product, one
      rounding; without probs a copy of grad_out[j]) for S[j] < P; rows nothing refers to are 0.
    - grad_probs[i, k] = dot(grad_out[i], permuted[S[i*topK+k]]) in fp32, in the blocked order
      (16 lanes, then a tree: _blocked_dot); 0 if dropped.
    """
    n, h = grad_out.shape
    topk = 1 if probs is None else probs.shape[1]
    s = sorted_indices.to(torch.int64)
    present = s < permuted_rows
    grad_permuted = torch.zeros((permuted_rows, h), dtype=permuted_dtype)
    j = torch.arange(s.numel())[present]  # the entries that point at a row
    if probs is None:
        grad_permuted[s[present]] = grad_out[j].to(permuted_dtype)
        return grad_permuted, None
    acc = _acc_dtype(grad_out.dtype)
    g = grad_out.to(acc)
    w = probs.to(acc).reshape(-1)
    grad_permuted[s[present]] = (g[j // topk] * w[j][:, None]).to(permuted_dtype)
    # grad_probs: one dot product per entry, in the blocked order; dropped entries are +0.
    dot = torch.zeros(n * topk, dtype=acc)
    if permuted_rows > 0:
        rows = permuted_tokens.to(acc)[s.clamp(max=permuted_rows - 1)]
        gi = g.repeat_interleave(topk, dim=0)  # grad_out[j / topK]
        dot = torch.where(present, _blocked_dot(gi, rows), dot)
    return grad_permuted, dot.to(probs.dtype).view(n, topk)


def _blocked_dot(a: Tensor, b: Tensor) -> Tensor:
    """Row-wise dot products of a and b (M, H) in moe-ep's order for grad_probs: lane l (0..15)
    starts at +0 and adds a[:, c] * b[:, c] (one rounded product, one add) for c = l, l+16, ...
    in increasing c; only real products are added (a partial block touches its first lanes only).
    Then lane[l] = lane[l] + lane[l + w] for l < w, for w = 8, 4, 2, 1; the result is lane 0."""
    m, h = a.shape
    lanes = torch.zeros((m, 16), dtype=a.dtype)
    for c0 in range(0, h, 16):
        w = min(16, h - c0)
        lanes[:, :w] = lanes[:, :w] + a[:, c0 : c0 + w] * b[:, c0 : c0 + w]
    for w in (8, 4, 2, 1):
        lanes[:, :w] = lanes[:, :w] + lanes[:, w : 2 * w]
    return lanes[:, 0]


# ---------------------------------------------------------------------------------------------
# padded_mode (SPEC §4.1): Megatron-LM's permute_with_padded_tokens / unpermute_with_padded_tokens,
# with the order moe-ep fixes for the sums (a token's slots in increasing slot order, fp32).


def permute_padded(tokens: Tensor, table: Tensor) -> Tuple[Tensor, Tensor]:
    """permuted[p] = tokens[table.flat[p]]; sorted_indices = the table in its own shape, int32."""
    ids = table.reshape(-1).long()
    return tokens[ids], table.to(torch.int32)


def unpermute_padded(src: Tensor, table: Tensor, probs: Optional[Tensor], n: int,
                     out_dtype: Optional[torch.dtype] = None) -> Tensor:
    """out[t] = sum over the slots p holding t, in increasing p, of probs.flat[p] * src[p] (fp32,
    the first term starting the sum, one rounding); unweighted without probs (permute_grad)."""
    acc = _acc_dtype(src.dtype)
    ids = table.reshape(-1).long()
    m = ids.numel()
    total = _RunningSum((n, src.shape[1]), acc)
    w = probs.reshape(-1).to(acc) if probs is not None else None
    for p in range(m):
        term = src[p].to(acc)
        if w is not None:
            term = w[p] * term
        present = torch.zeros((n, 1), dtype=torch.bool)
        present[ids[p]] = True
        total.add(term.expand(n, -1), present)
    return total.total.to(out_dtype or src.dtype)


def unpermute_grad_padded(grad_out: Tensor, table: Tensor, probs: Optional[Tensor],
                          permuted: Optional[Tensor],
                          permuted_dtype: Optional[torch.dtype] = None) -> Tuple[Tensor, Optional[Tensor]]:
    """grad_permuted[p] = probs.flat[p] * grad_out[table.flat[p]] (a copy without probs);
    grad_probs.flat[p] = the blocked dot of grad_out[table.flat[p]] and permuted[p], in probs'
    shape and dtype."""
    ids = table.reshape(-1).long()
    g = grad_out[ids]
    dtype = permuted_dtype or grad_out.dtype
    if probs is None:
        return g.to(dtype), None
    acc = _acc_dtype(grad_out.dtype)
    w = probs.reshape(-1, 1).to(acc)
    grad_permuted = (g.to(acc) * w).to(dtype)
    dot = _blocked_dot(g.to(acc), permuted.to(acc))
    return grad_permuted, dot.to(probs.dtype).reshape(probs.shape)
