"""The "moe_ep" experts implementation for Hugging Face transformers (5.x).

transformers decorates each MoE family's experts class with @use_experts_implementation; its
forward looks up config._experts_implementation in ALL_EXPERTS_FUNCTIONS and calls
fn(self, hidden_states (T, H), top_k_index (T, K), top_k_weights (T, K)) -> (T, H). Ours runs
moe_ep.torch.nn.ExpertParallel: dispatch_v2 -> this rank's experts with the module's own math
(gate_up or up projection, _apply_gate or act_fn, biases, transposed weights, post-expert norm)
-> combine_v2. The module's expert parameters are cut to this rank's experts (shard_experts).
"""

from __future__ import annotations

from typing import Iterator, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from moe_ep import InvalidArgumentError, UnsupportedError
from moe_ep.torch.nn import ExpertParallel, Lockstep, local_expert_range

IMPLEMENTATION = "moe_ep"

# The decorator's flags: their presence is how an experts module is recognised.
_FLAGS = ("has_gate", "has_bias", "is_transposed", "is_concatenated", "_is_expert_parallel")


def is_experts_module(module: torch.nn.Module) -> bool:
    """True for an instance of a class decorated with transformers' @use_experts_implementation."""
    return all(hasattr(module, f) for f in _FLAGS)


def experts_modules(model: torch.nn.Module) -> Iterator[Tuple[str, torch.nn.Module]]:
    """(qualified name, module) of every experts module of model, in forward order."""
    for name, module in model.named_modules():
        if is_experts_module(module):
            yield name, module


def expert_param_names(module: torch.nn.Module) -> List[str]:
    """The module's per-expert parameters (leading dim num_experts), the ones each rank cuts to
    its own experts: gate_up_proj or up_proj, down_proj and their biases."""
    first = "gate_up_proj" if module.has_gate else "up_proj"
    names = [first, "down_proj"]
    if module.has_bias:
        names += [first + "_bias", "down_proj_bias"]
    return names


def expert_parameters(model: torch.nn.Module) -> List[torch.nn.Parameter]:
    """This rank's expert parameters of every experts module (after shard_experts: its slices)."""
    return [getattr(m, p) for _, m in experts_modules(model) for p in expert_param_names(m)]


def average_gradients(model: torch.nn.Module, comm=None) -> None:
    """moe_ep.torch.nn.average_gradients with model's expert parameters as the rank-local ones:
    after backward of each rank's mean loss on its own batch, every gradient is that of the mean
    over the ranks' batches (replicated ones averaged over comm, expert ones divided by W)."""
    from moe_ep.torch.nn import average_gradients as _average

    _average(model, comm, expert_params=expert_parameters(model))


def check_recognised(name: str, module: torch.nn.Module) -> None:
    """InvalidArgumentError/UnsupportedError naming what moe_ep cannot run in an experts module."""
    cls = type(module).__name__
    n = getattr(module, "num_experts", None)
    if not isinstance(n, int) or n <= 0:
        raise UnsupportedError(
            f"moe_ep experts implementation: {name} ({cls}) has no integer num_experts "
            f"(got {n!r}); moe_ep runs experts modules that carry num_experts and fused "
            f"gate_up_proj/up_proj and down_proj parameters")
    for p in expert_param_names(module):
        t = getattr(module, p, None)
        if not isinstance(t, Tensor) or t.dim() < 2:
            raise UnsupportedError(
                f"moe_ep experts implementation: {name} ({cls}) has no per-expert parameter "
                f"{p!r} (got {type(t).__name__}); the flags say has_gate={module.has_gate}, "
                f"has_bias={module.has_bias}")
    if not module.has_gate and not hasattr(module, "act_fn"):
        raise UnsupportedError(
            f"moe_ep experts implementation: {name} ({cls}) has has_gate=False and no act_fn")
    if getattr(module, "has_post_expert_norm", False) and not hasattr(module, "post_expert_norm"):
        raise UnsupportedError(
            f"moe_ep experts implementation: {name} ({cls}) has has_post_expert_norm=True and no "
            f"post_expert_norm")


def _linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], transposed: bool) -> Tensor:
    y = x @ weight if transposed else F.linear(x, weight)
    return y if bias is None else y + bias


def local_experts(module: torch.nn.Module):
    """The LocalExperts function of an experts module whose parameters hold this rank's experts:
    the module's own math, expert by expert, on the rows dispatch_v2 grouped by local expert
    (x (sum(counts), H), cast to the weights' dtype; counts[l] rows for local expert l)."""

    def run(x: Tensor, counts: List[int]) -> Tensor:
        names = expert_param_names(module)
        w_up, w_down = getattr(module, names[0]), getattr(module, names[1])
        b_up, b_down = (getattr(module, n) for n in names[2:]) if module.has_bias else (None, None)
        x = x.to(w_up.dtype)
        outs, start = [], 0
        for l, n in enumerate(counts):
            if n == 0:
                continue
            rows = x[start:start + n]
            start += n
            h = _linear(rows, w_up[l], None if b_up is None else b_up[l], module.is_transposed)
            h = module._apply_gate(h) if module.has_gate else module.act_fn(h)
            h = _linear(h, w_down[l], None if b_down is None else b_down[l], module.is_transposed)
            if getattr(module, "has_post_expert_norm", False):
                h = module.post_expert_norm(h)
            outs.append(h)
        return torch.cat(outs)  # ExpertParallel calls it with at least one row

    return run


def _cut(name: str, module: torch.nn.Module, start: int, stop: int) -> None:
    for p in expert_param_names(module):
        t = getattr(module, p)
        if t.shape[0] != module.num_experts:
            raise InvalidArgumentError(
                f"moe_ep.transformers.shard_experts: {name}.{p} has {t.shape[0]} experts in dim "
                f"0, its module's num_experts is {module.num_experts}")
        if t.is_meta:  # a loader fills it
            part = torch.empty(t[start:stop].shape, dtype=t.dtype, device="meta")
            setattr(module, p, torch.nn.Parameter(part, requires_grad=t.requires_grad))
        else:  # in place: an optimizer made before the cut keeps the same Parameter
            with torch.no_grad():
                t.data = t.data[start:stop].clone()


def _attach(name: str, module: torch.nn.Module, comm, transport: str,
            lockstep: Optional[Lockstep]) -> ExpertParallel:
    """Cuts module to this rank's experts and gives it its ExpertParallel (module._moe_ep)."""
    check_recognised(name, module)
    start, stop = local_expert_range(module.num_experts, comm,
                                     f"moe_ep.transformers.shard_experts ({name})")
    _cut(name, module, start, stop)
    ep = ExpertParallel(module.num_experts, local_experts(module), comm, transport=transport,
                        lockstep=lockstep)
    object.__setattr__(module, "_moe_ep", ep)  # not a submodule: no state_dict keys
    return ep


def shard_experts(model: torch.nn.Module, comm=None, *, transport: str = "",
                  lockstep: Optional[Lockstep] = None) -> int:
    """Cuts every experts module of model to this rank's experts and attaches its
    ExpertParallel (module._moe_ep). Rank r of comm (default MPI.COMM_WORLD, world size W) keeps
    experts [r * E / W, (r + 1) * E / W) of each per-expert parameter (E = module.num_experts),
    in place (a Parameter keeps its identity; meta parameters stay meta, at the local shape, for
    a loader to fill). A module already cut keeps its communicator and transport (lockstep, when
    given, is set). Returns the number of experts modules. Errors, raised alike on every rank:
    UnsupportedError for an experts module moe_ep does not recognise, InvalidArgumentError when
    W does not divide E (with the numbers)."""
    count = 0
    for name, module in experts_modules(model):
        ep = getattr(module, "_moe_ep", None)
        if ep is None:
            _attach(name, module, comm, transport, lockstep)
        elif lockstep is not None:
            ep.lockstep = lockstep
        count += 1
    return count


def set_overlap(model: torch.nn.Module, overlap=True, comm=None) -> int:
    """Runs every MoE layer of model as two micro-batches whose dispatch and combine travel while
    the other's experts compute (overlap True), the same two one after the other ("split": the
    same bits), or as one batch (False); ExpertParallel's overlap. Cuts modules not yet cut to
    this rank's experts of comm (default MPI.COMM_WORLD), as shard_experts. Returns the number of
    experts modules. InvalidArgumentError for another value of overlap."""
    if not (isinstance(overlap, bool) or overlap == "split"):
        raise InvalidArgumentError(
            f"set_overlap: overlap = {overlap!r} must be False, True or 'split'")
    shard_experts(model, comm)
    count = 0
    for _, module in experts_modules(model):
        module._moe_ep.overlap = overlap
        count += 1
    return count


def moe_ep_experts_forward(self, hidden_states: Tensor, top_k_index: Tensor,
                           top_k_weights: Tensor) -> Tensor:
    """The function registered as experts implementation "moe_ep": hidden_states (T, H) in the
    model's dtype, top_k_index (T, K) integer ids in [0, num_experts), top_k_weights (T, K) ->
    (T, H) in hidden_states' dtype (ExpertParallel.forward). A module not yet cut (a model loaded
    whole by transformers' own from_pretrained) is cut to this rank's experts of MPI.COMM_WORLD
    at its first call; every rank runs the same layers in the same order, so the cut is the same
    everywhere. Errors as ExpertParallel's and shard_experts'."""
    ep = getattr(self, "_moe_ep", None)
    if ep is None:
        ep = _attach(type(self).__name__, self, None, "", None)
    return ep(hidden_states, top_k_index, top_k_weights)


def register() -> None:
    """Registers "moe_ep" in transformers' ALL_EXPERTS_FUNCTIONS (idempotent)."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(IMPLEMENTATION, moe_ep_experts_forward)
