"""Data-parallel attention, expert-parallel MoE: keeping ranks that run their own sequences in
step for the MoE layers (docs/design.md, "Real models").

Each rank calls model(...) / model.generate(...) on its own batch. Every call of the model's
forward is one Lockstep round (an allreduce of "still working" and the token count), taken by a
forward pre-hook; the round's largest token count gives the MoE layers' global_bs, so they need
no round of their own. A rank that is done (its sequences finished, or it had none) leaves the
`with` block, and there it keeps answering rounds, running every MoE layer once with 0 tokens per
round, until no rank works any more. So ranks may run different numbers of steps with different
token counts and never wait on a collective that a peer will not join.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from moe_ep import UnsupportedError
from moe_ep.torch.nn import Lockstep
from moe_ep.transformers._experts import experts_modules, shard_experts


def _tokens(args, kwargs) -> int:
    ids = kwargs.get("input_ids", args[0] if args else None)
    if ids is not None:
        return int(ids.numel())
    embeds = kwargs.get("inputs_embeds")
    if embeds is not None:
        return int(embeds.shape[:-1].numel())
    raise UnsupportedError("moe_ep.transformers.lockstep: a model call without input_ids or "
                           "inputs_embeds; the round needs this rank's token count")


def _top_k(model: torch.nn.Module) -> int:
    config = getattr(model, "config", None)
    config = getattr(config, "get_text_config", lambda: config)()
    k = getattr(config, "num_experts_per_tok", None)
    if not isinstance(k, int) or k <= 0:
        raise UnsupportedError(
            f"moe_ep.transformers.lockstep: the model's config has no num_experts_per_tok "
            f"(got {k!r}); the idle MoE calls need the routing's top-k")
    return k


@contextlib.contextmanager
def lockstep(model: torch.nn.Module, comm=None) -> Iterator[Lockstep]:
    """with lockstep(model, comm): run this rank's model calls (generate, forward), any number,
    any token counts, 0 calls included. On leaving, the rank runs idle MoE steps until every rank
    of comm has left its block. Every rank of comm must enter the block. Yields the Lockstep
    (its global_bs is the current step's)."""
    step = Lockstep(comm)
    shard_experts(model, step.comm, lockstep=step)
    layers = [m for _, m in experts_modules(model)]
    k = _top_k(model)

    def pre_hook(_module, args, kwargs):
        step.step(_tokens(args, kwargs), active=True)

    def idle():
        with torch.no_grad():
            for m in layers:
                dtype = m.down_proj.dtype
                h = m.down_proj.shape[-1 if m.is_transposed else -2]
                m._moe_ep(torch.zeros(0, h, dtype=dtype), torch.zeros(0, k, dtype=torch.int32),
                          torch.zeros(0, k, dtype=torch.float32))

    handle = model.register_forward_pre_hook(pre_hook, with_kwargs=True)
    try:
        yield step
    finally:
        handle.remove()
        step.finish(idle)
        for m in layers:
            m._moe_ep.lockstep = None
