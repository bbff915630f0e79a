"""Expert parallelism as a torch.nn module: a MoE layer's experts spread over the ranks of an MPI
communicator, each rank holding only its own.

ExpertParallel takes what a router gives (hidden states, top-k expert ids and weights) and runs
dispatch_v2 (SPEC §1) -> this rank's experts -> combine_v2 (SPEC §2), differentiable in the hidden
states, the weights and the experts' parameters (SPEC §6). Ranks may hold different token counts,
0 included; the global batch bound (global_bs) is agreed among the ranks unless a Lockstep
(below) or the caller gives it.

Lockstep keeps ranks that run their own sequences through the rest of the model (data-parallel
attention) in step for the MoE layers: every model step is one round in which the ranks agree on
whether anyone still has work and on the largest token count; a rank with no work left runs the
MoE layers with 0 tokens until every rank is done. docs/design.md ("Real models") has the
picture.
"""

from __future__ import annotations

from typing import Callable, Iterable, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor

from moe_ep import InvalidArgumentError, TimeoutError
from moe_ep.torch.distributed import combine_v2, dispatch_v2

# experts(x, counts) -> y: x (sum(counts), H) holds this rank's received rows grouped by local
# expert (counts[l] rows for local expert l, in order); y has x's shape.
LocalExperts = Callable[[Tensor, List[int]], Tensor]


def _comm_or_world(comm):
    if comm is None:
        from mpi4py import MPI

        return MPI.COMM_WORLD
    return comm


def local_expert_range(num_experts: int, comm=None, op: str = "ExpertParallel") -> Tuple[int, int]:
    """The experts [start, stop) that this rank of comm hosts: rank r holds experts
    [r * L, (r + 1) * L) with L = num_experts / world size (SPEC §1.1's placement without shared
    or redundant slots). InvalidArgumentError when the world size does not divide num_experts."""
    comm = _comm_or_world(comm)
    world, rank = comm.Get_size(), comm.Get_rank()
    if num_experts <= 0 or num_experts % world:
        raise InvalidArgumentError(
            f"{op}: num_experts = {num_experts} is not a positive multiple of the {world} ranks "
            f"(ep_world_size): each rank must host the same number of experts. Run on a world "
            f"size that divides {num_experts}, or pad the experts to a multiple of {world} "
            f"(e.g. {-(-num_experts // world) * world}) with redundant copies of the busiest ones "
            f"and map their ids in the router.")
    local = num_experts // world
    return rank * local, (rank + 1) * local


def _deadline_s() -> float:
    """$MOE_EP_TIMEOUT_S (default 300), as the C++ side reads it: a positive number of seconds."""
    import math
    import os

    text = os.environ.get("MOE_EP_TIMEOUT_S", "300")
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not math.isfinite(value) or value <= 0:
        raise InvalidArgumentError(
            f"MOE_EP_TIMEOUT_S = {text!r} must be a positive number of seconds (the deadline of "
            f"every wait for the other ranks)")
    return value


# Requests abandoned at their deadline, with their buffers: MPI may still write into those when
# the late rank joins, so they must outlive the call (the communicator is unusable after that).
_abandoned: List[tuple] = []


def wait(req, comm, what: str, buffers: tuple = ()) -> None:
    """Waits for an MPI request within $MOE_EP_TIMEOUT_S, polling (yielding after the first
    thousand polls): moe_ep.TimeoutError naming what and this rank when not every rank of comm
    joined in time. buffers: the request's send/receive buffers, kept alive if it is abandoned."""
    import time

    limit = _deadline_s()
    start = time.monotonic()
    spins = 0
    while not req.Test():
        spins += 1
        if spins > 1000:
            time.sleep(0.0002)
        if time.monotonic() - start > limit:
            _abandoned.append((req, buffers))
            raise TimeoutError(
                f"{what}: rank {comm.Get_rank()} waited {limit:g} s ($MOE_EP_TIMEOUT_S) and not "
                f"every one of the {comm.Get_size()} ranks joined: a rank died or stopped calling "
                f"the MoE layers (every rank must run the same MoE layers in the same order; see "
                f"moe_ep.transformers.lockstep). This communicator is unusable now.")


def allreduce_max(comm, values: np.ndarray, what: str) -> np.ndarray:
    """The elementwise MAX of values (int64) over comm, within $MOE_EP_TIMEOUT_S: a rank that
    stopped taking part (died, or left the model loop early) is a moe_ep.TimeoutError naming the
    round, not a hang."""
    from mpi4py import MPI

    got = np.empty_like(values)
    wait(comm.Iallreduce(values, got, op=MPI.MAX), comm, what, (values, got))
    return got


class Lockstep:
    """The model-step rounds of data-parallel attention with expert-parallel MoE.

    Every rank calls step(tokens) once per model step it runs (tokens: this rank's token count in
    that step, 0 allowed); step returns whether any rank still has work, and sets global_bs for
    the step's MoE layers (ep_world_size * the largest count). A rank whose work is done calls
    finish(idle), which keeps taking part (idle() runs every MoE layer once with 0 tokens) until
    every rank is done. The rounds are one MPI allreduce each, on comm."""

    def __init__(self, comm=None):
        self.comm = _comm_or_world(comm)
        self.world = self.comm.Get_size()
        self.global_bs: Optional[int] = None

    def step(self, tokens: int, active: bool = True) -> bool:
        """One round: tokens, this rank's token count in this model step (rows of the MoE layers'
        hidden states, >= 0); active False from a rank that is done. Returns whether any rank is
        active. Blocks until every rank of comm joined (TimeoutError past $MOE_EP_TIMEOUT_S)."""
        self._buf = np.array([int(active), int(tokens)], dtype=np.int64)
        got = allreduce_max(self.comm, self._buf, "Lockstep.step")
        self.global_bs = self.world * max(1, int(got[1]))
        return bool(got[0])

    def finish(self, idle: Callable[[], None]) -> int:
        """Runs idle() once per step the other ranks still take; returns how many."""
        rounds = 0
        while self.step(0, active=False):
            idle()
            rounds += 1
        self.global_bs = None
        return rounds


class ExpertParallel(torch.nn.Module):
    """One MoE layer's experts, expert-parallel over comm (SPEC §1-2, §6).

    num_experts: E, the routed experts of the layer (top-k ids index them); comm: an mpi4py
    communicator (None: MPI.COMM_WORLD) whose size W divides E; this rank hosts experts
    local_expert_range(E, comm). experts: LocalExperts, this rank's expert computation (the
    module's own math); a torch.nn.Module passed here is registered as a submodule, so its
    parameters (this rank's slices only) are this module's. transport: "shm", "mpi" or ""
    (dispatch_v2's). lockstep: a Lockstep whose global_bs this layer uses while it is set (no
    round of its own). overlap: False (default) runs the layer's tokens as one batch; True
    splits them into two micro-batches (the first ceil(T/2) tokens, then the rest) whose
    dispatch and combine travel while the other's experts compute (async_op=True): micro-batch
    1's dispatch during micro-batch 0's experts, micro-batch 0's combine during micro-batch 1's.
    "split" runs the same two micro-batches one after the other (the reference of overlap=True:
    the same bits, since each half computes exactly the same; the one-batch result may differ from
    both by the expert math's own dependence on the row count).

    forward(hidden_states (T, H) bf16/fp16/fp32, top_k_ids (T, K) integer in [0, E),
    top_k_weights (T, K) float) -> (T, H) in hidden_states' dtype: the weighted sum of each token's
    experts' outputs, sum_k w[t, k] * expert_{ids[t, k]}(x[t]) (an id of -1 is an inactive entry,
    as in dispatch_v2). T may differ across ranks and be 0; H, K and the dtype may not.
    Errors: InvalidArgumentError (shapes, ids out of range, the world size), raised by the
    collective on every rank when one rank's arguments are bad (RemoteError elsewhere)."""

    def __init__(self, num_experts: int, experts: LocalExperts, comm=None, *,
                 transport: str = "", lockstep: Optional[Lockstep] = None,
                 overlap=False):
        super().__init__()
        self.comm = _comm_or_world(comm)
        self.num_experts = int(num_experts)
        self.start, self.stop = local_expert_range(self.num_experts, self.comm)
        self.ep_world_size = self.comm.Get_size()
        self.ep_rank_id = self.comm.Get_rank()
        self.experts = experts
        self.transport = transport
        self.lockstep = lockstep
        if not (isinstance(overlap, bool) or overlap == "split"):
            raise InvalidArgumentError(
                f"ExpertParallel: overlap = {overlap!r} must be False, True or 'split'")
        self.overlap = overlap
        self.last_input: Optional[tuple] = None  # (H, dtype, K) of the last call: idle calls' shape

    @property
    def num_local_experts(self) -> int:
        return self.stop - self.start

    def _global_bs(self, tokens: int) -> int:
        if self.lockstep is not None and self.lockstep.global_bs is not None:
            return self.lockstep.global_bs
        got = allreduce_max(self.comm, np.array([tokens], dtype=np.int64),
                            "ExpertParallel (agreeing on global_bs)")
        return self.ep_world_size * max(1, int(got[0]))

    def forward(self, hidden_states: Tensor, top_k_ids: Tensor, top_k_weights: Tensor) -> Tensor:
        # No checks of our own before the collectives: dispatch_v2 checks the shapes and the ids
        # on every rank and raises a rank's bad argument there (RemoteError on the others), where
        # a check here would raise on one rank and leave the others waiting.
        tokens = hidden_states.shape[0] if hidden_states.dim() else 0
        self.last_input = (hidden_states.shape[-1], hidden_states.dtype, top_k_ids.shape[-1])
        args = dict(group_ep=self.comm, ep_world_size=self.ep_world_size,
                    ep_rank_id=self.ep_rank_id, moe_expert_num=self.num_experts,
                    global_bs=self._global_bs(tokens), exact_size=True, transport=self.transport)
        ids = top_k_ids.to(torch.int32)
        scales = top_k_weights.to(torch.float32)
        if self.overlap is False:
            d = dispatch_v2(hidden_states, ids, **args)
            return combine_v2(self._experts_of(d, hidden_states.dtype), ids,
                              d.assist_info_for_combine, d.ep_recv_counts, scales,
                              handle=d.handle, **args)
        # Two micro-batches: global_bs for halves of at most ceil(max T / 2) tokens.
        most = args["global_bs"] // self.ep_world_size
        args["global_bs"] = self.ep_world_size * max(1, -(-most // 2))
        half = -(-tokens // 2)
        parts = [slice(0, half), slice(half, tokens)]
        run_async = self.overlap is True
        started = [dispatch_v2(hidden_states[p], ids[p], async_op=run_async, **args)
                   for p in parts] if run_async else None
        outs = []
        for i, p in enumerate(parts):
            d = started[i].wait() if run_async else dispatch_v2(hidden_states[p], ids[p], **args)
            outs.append(combine_v2(self._experts_of(d, hidden_states.dtype), ids[p],
                                   d.assist_info_for_combine, d.ep_recv_counts, scales[p],
                                   handle=d.handle, async_op=run_async, **args))
        return torch.cat([o.wait() for o in outs] if run_async else outs)

    def _experts_of(self, d, dtype) -> Tensor:
        x = d.expand_x  # exact_size: the rows received, grouped by local expert
        y = self.experts(x, d.expert_token_nums.tolist()) if x.shape[0] else x
        return y.to(dtype)  # the rows go back in the dtype they came in


def token_weight(tokens: int, comm=None) -> float:
    """W * tokens / (the tokens of all ranks): multiply this rank's mean loss by it before
    backward when the ranks' batches hold different token counts (loss terms), so that, after
    average_gradients, every gradient is that of the mean over the concatenated batch (1.0 when
    the counts are equal). Blocks for one allreduce (TimeoutError past $MOE_EP_TIMEOUT_S)."""
    from mpi4py import MPI

    comm = _comm_or_world(comm)
    mine = np.array([int(tokens)], dtype=np.int64)
    total = np.empty_like(mine)
    wait(comm.Iallreduce(mine, total, op=MPI.SUM), comm, "token_weight", (mine, total))
    if int(total[0]) <= 0:
        raise InvalidArgumentError(f"token_weight: the ranks hold {int(total[0])} tokens in all; "
                                   f"the mean loss needs at least 1")
    return comm.Get_size() * int(tokens) / int(total[0])


def average_gradients(module_or_params, comm=None, *,
                      expert_params: Iterable[Tensor] = ()) -> None:
    """Data-parallel gradient averaging for expert-parallel training, after backward.

    module_or_params: a module or parameters (those with requires_grad count; a gradient that
    is None counts as zeros and is set so: an expert that got no rows, a branch not taken). Every
    parameter not in expert_params is replicated on every rank and its gradient is averaged over
    comm (one allreduce per dtype, summed in fp32 for bf16/fp16, fp64 for fp64). An expert
    parameter lives on one rank only and its gradient already holds every rank's tokens' share
    (combine_v2's backward brings them home), so it is divided by the world size W. With each
    rank's loss the mean over its own batch (times token_weight when the ranks' token counts
    differ), every gradient is then that of the mean over the concatenated batch, what one
    process computes. Every rank must pass the same parameters in the same order (same shapes).
    Blocks (TimeoutError past $MOE_EP_TIMEOUT_S)."""
    from mpi4py import MPI

    comm = _comm_or_world(comm)
    world = comm.Get_size()
    experts = {id(p) for p in expert_params}
    params = module_or_params.parameters() if isinstance(module_or_params, torch.nn.Module) \
        else module_or_params
    replicated: dict = {}
    for p in params:
        if not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        if id(p) in experts:
            p.grad.div_(world)
        else:
            replicated.setdefault(p.grad.dtype, []).append(p)
    for dtype, ps in replicated.items():
        wide = torch.float64 if dtype == torch.float64 else torch.float32
        flat = torch.cat([p.grad.reshape(-1).to(wide) for p in ps])
        total = torch.empty_like(flat)
        wait(comm.Iallreduce(flat.numpy(), total.numpy(), op=MPI.SUM), comm,
             "average_gradients", (flat, total))
        total.div_(world)
        offset = 0
        for p in ps:
            n = p.grad.numel()
            p.grad.copy_(total[offset: offset + n].view_as(p.grad))
            offset += n


__all__: Sequence[str] = ["ExpertParallel", "Lockstep", "allreduce_max", "average_gradients",
                          "local_expert_range", "token_weight", "wait"]
