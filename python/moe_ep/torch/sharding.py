"""SPEC §5: DTensor sharding rules for the local ops, generated from the C++ strategy table.

For every op of SPEC §4 this registers a rule with
torch.distributed.tensor.experimental.register_sharding. The rule asks moe_ep._C.strategies()
(the table of src/sharding/strategy.cc, the one the C++ sharded ops use) for the op's two
strategies, R (everything Replicate) and S (hidden dimension Shard(1), index tensors and probs
Replicate, grad_probs Partial), and hands them to DTensor, which picks one by its own cost model
and redistributes inputs placed otherwise. Nothing here restates the table.

DTensor's choice (torch 2.13) is not the C++ cost rule's: it drops S when H is smaller than the
mesh (a Shard(1) input with fewer columns than ranks is "not shardable"), and it prices
Shard(0) -> Shard(1) as an all-gather plus a fixed penalty, so Shard(0) tokens go to R unless
the tensor is large (the C++ rule picks S). Either strategy gives the single-process values
(grad_probs under S up to the rounding below).

Outputs the table marks absent ("-": grad_probs without probs) are the op's empty (0,) tensor;
they are declared Replicate. Under DTensor each shard's grad_probs is rounded to probs' dtype
before DTensor sums the Partial in that dtype (the C++ sharded ops keep fp32 partial sums
instead): with fp32 probs the result differs from one process by fp32 re-association only; with
bf16/fp16 probs by up to (ranks + 1) * u * sum_h |g_h x_h| (u = 2^-8 for bf16, 2^-11 for fp16),
which exceeds the result itself when the shards' dot products cancel (docs/sharding.md).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding

from moe_ep import _C

# torch op -> the C++ table's op name (ShardedOp).
OPS: Dict[str, str] = {
    "token_permute": "permute",
    "token_permute_grad": "permute_grad",
    "token_permute_grad_v2": "permute_grad_v2",
    "token_unpermute": "unpermute",
    "_token_unpermute": "unpermute_with_saved",
    "token_unpermute_grad": "unpermute_grad",
    "token_unpermute_grad_v2": "unpermute_grad_v2",
}


def _placement(p):
    if p is None:
        return None
    kind, dim = p
    if kind == "replicate":
        return Replicate()
    if kind == "shard":
        return Shard(dim)
    return Partial()


def strategies_for(table_op: str, has_probs: bool, has_permuted_tokens: bool = True):
    """The C++ table's strategies of `table_op` as torch placements:
    [(name, {arg: placement or None}, [output placement or None])]."""
    out = []
    for s in _C.strategies(table_op, has_probs, has_permuted_tokens):
        inputs = {name: _placement(p) for name, p, _ in s["inputs"]}
        outputs = [_placement(p) for _, p, _ in s["outputs"]]
        out.append((s["name"], inputs, outputs))
    return out


def _make_rule(overload, table_op: str):
    arg_names = [a.name for a in overload._schema.arguments]

    def rule(*args, **kwargs):
        given = dict(zip(arg_names, args))
        given.update(kwargs)
        has_probs = given.get("probs") is not None
        has_permuted = given.get("permuted_tokens") is not None
        result: List[Tuple[list, list]] = []
        for _, inputs, outputs in strategies_for(table_op, has_probs, has_permuted):
            out_pl = [Replicate() if p is None else p for p in outputs]

            def pl(name, value):
                # Non-tensor arguments and absent optional tensors have no placement.
                return inputs.get(name) if value is not None and name in inputs else None

            in_pl = [pl(n, v) for n, v in zip(arg_names, args)]
            in_pl += [pl(n, v) for n, v in kwargs.items()]
            result.append((out_pl, in_pl))
        return result

    return rule


_registered = False


def register_rules() -> None:
    """Registers the rules (idempotent; done when moe_ep.torch is imported)."""
    global _registered
    if _registered:
        return
    for torch_name, table_op in OPS.items():
        overload = getattr(torch.ops.moe_ep, torch_name).default
        register_sharding(overload)(_make_rule(overload, table_op))
    _registered = True


def rule_table(op: str, has_probs: bool, has_permuted_tokens: bool = True):
    """What the rule of torch op `op` gives DTensor, for docs and tests."""
    return strategies_for(OPS[op], has_probs, has_permuted_tokens)


__all__ = ["OPS", "register_rules", "rule_table", "strategies_for"]
