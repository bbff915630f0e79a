"""Data-parallel attention, expert-parallel MoE: keeping ranks that run their own sequences in
step for the MoE layers (docs/design.md, "Real models").

Each rank calls model(...) / model.generate(...) on its own batch. Every call of the model's
forward is one Lockstep round (an allreduce of "still working" and the token count), taken by a
forward pre-hook; the round's largest token count gives the MoE layers' global_bs, so they need
no round of their own. A rank that is done (its sequences finished, or it had none) leaves the
`with` block, and there it keeps answering rounds, running every MoE layer once with 0 tokens per
round, until no rank works any more. So ranks may run different numbers of steps with different
token counts and never wait on a collective that a peer will not join.

Assumed: each model call runs every experts module once, in module order (true of the decoder
families transformers decorates; a model that loops over its layers is not), and the block is
inference (an idle rank takes no part in the others' backward).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from moe_ep import InvalidArgumentError, UnsupportedError
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


_TOP_K_NAMES = ("num_experts_per_tok", "top_k_experts", "moe_topk", "num_selected_experts")


def _top_k(model: torch.nn.Module) -> int:
    """The routing's top-k from the model's (text) config: dispatch_v2 needs the same K on every
    rank, an idle one's 0 tokens included."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in _TOP_K_NAMES:
        k = getattr(text, name, None)
        if isinstance(k, int) and k > 0:
            return k
    raise UnsupportedError(
        f"moe_ep.transformers.lockstep: the model's config has none of {', '.join(_TOP_K_NAMES)};"
        f" a rank without tokens needs the routing's top-k for its idle MoE calls")


def _idle_input(module: torch.nn.Module, top_k: int):
    """A 0-token call's tensors: the (H, dtype, K) of the layer's last real call, else the
    weights' and the config's (a rank that never had tokens)."""
    last = module._moe_ep.last_input
    if last is None:
        w = module.down_proj
        last = (w.shape[-1 if module.is_transposed else -2], w.dtype, top_k)
    h, dtype, k = last
    return (torch.zeros(0, h, dtype=dtype), torch.zeros(0, k, dtype=torch.int32),
            torch.zeros(0, k, dtype=torch.float32))


def _communicator(model: torch.nn.Module, comm):
    """The layers' communicator; comm, when given, must be the same size."""
    cut = [m._moe_ep.comm for _, m in experts_modules(model) if getattr(m, "_moe_ep", None)]
    if comm is None:
        return cut[0] if cut else None
    if cut and cut[0].Get_size() != comm.Get_size():
        raise InvalidArgumentError(
            f"moe_ep.transformers.lockstep: comm has {comm.Get_size()} ranks, the model's MoE "
            f"layers run on a communicator of {cut[0].Get_size()}: pass theirs (or none)")
    return comm


@contextlib.contextmanager
def lockstep(model: torch.nn.Module, comm=None) -> Iterator[Lockstep]:
    """with lockstep(model, comm): run this rank's model calls (generate, forward: any number, any
    token counts, 0 calls included) for inference. On leaving normally, the rank runs idle MoE
    steps until every rank of comm has left its block. Every rank of comm must enter the block.
    comm: default the communicator the model's MoE layers were cut over (MPI.COMM_WORLD when not
    cut yet). Yields the Lockstep (its global_bs is the current step's). Errors:
    InvalidArgumentError for a comm of another size than the layers'; UnsupportedError for a
    model call without input_ids or inputs_embeds, or a config without the routing's top-k; moe_ep.TimeoutError when a rank does not join
    a round within $MOE_EP_TIMEOUT_S. An exception inside the block leaves it without the idle
    steps (the other ranks then meet their deadline)."""
    step = Lockstep(_communicator(model, comm))
    shard_experts(model, step.comm, lockstep=step)
    layers = [m for _, m in experts_modules(model)]
    top_k = _top_k(model)

    def pre_hook(_module, args, kwargs):
        step.step(_tokens(args, kwargs), active=True)

    def idle():
        with torch.no_grad():
            for m in layers:
                m._moe_ep(*_idle_input(m, top_k))

    handle = model.register_forward_pre_hook(pre_hook, with_kwargs=True)
    try:
        yield step
        handle.remove()
        step.finish(idle)
    finally:
        handle.remove()
        for m in layers:
            m._moe_ep.lockstep = None
