"""Huawei Ascend's torch_npu MoE ops under their own names, on CPU over MPI.

A program written for torch_npu runs here by swapping its import and its group set-up:

    import moe_ep.torch_npu as torch_npu          # instead of: import torch_npu
    from mpi4py import MPI
    ep_comm = MPI.COMM_WORLD.Split(...)           # instead of: dist.new_group(backend="hccl", ...)
    ep_hcomm_info = torch_npu.group_name(ep_comm)  # instead of: ..get_hccl_comm_name(rank)

The ops take exactly torch_npu's keyword names, defaults and output tuples
(npu_moe_distribute_dispatch_v2 / combine_v2, npu_moe_token_permute / unpermute and their grad
ops; SPEC §1, §2, §4). group_ep and group_tp are names: those group_name() returned, or that
register_group() gave an mpi4py communicator; group_tp "" means no TP group. Everything else is
moe_ep.torch's (errors, deadlines, autograd): see its documentation. Tensors are CPU tensors;
importing this module makes torch_npu's device calls no-ops on CPU, where torch itself lacks
them (a torch with NPU support keeps its own), so that the ported program's device calls need no
edit: ``Tensor.npu()`` and ``nn.Module.npu()`` return the object itself, and ``torch.npu`` (also
``moe_ep.torch_npu.npu``) has set_device, current_device, device_count, is_available,
synchronize, empty_cache, manual_seed(_all), Event, Stream, current_stream, default_stream and
stream (see _Npu for what each returns).

One addition, invisible to the caller: npu_moe_distribute_dispatch_v2 keeps its plan (SPEC §7)
with the ep_recv_counts tensor it returned, and npu_moe_distribute_combine_v2 given that very
tensor as ep_send_counts uses it, so that only the rows travel back (the same bits) and the pair
is differentiable (SPEC §6). Not under torch.compile (traced tensors have no identity to keep it
with): there the pair runs as moe_ep.torch's dispatch_v2 and combine_v2 without handle= (the
same bits; the graph-mode example, examples/python/ascend_graph_mode.py, compiles it with
fullgraph=True).
"""

from __future__ import annotations

import importlib.util
import itertools
import sys
import weakref
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

from moe_ep import InvalidArgumentError
import moe_ep.torch as _mt

_named: Dict[str, object] = {}  # group name -> mpi4py communicator
_names: Dict[int, str] = {}  # id(communicator) -> its name
_counter = itertools.count()
# id(ep_recv_counts tensor) -> the handle tensor of the dispatch that returned it
_plans: Dict[int, Tensor] = {}


def _check_comm(op: str, comm) -> None:
    """comm is an mpi4py intracommunicator other than MPI.COMM_NULL (what group_ep / group_tp
    name: moe_ep.torch's ops duplicate it on first use)."""
    # Not imported here: importing mpi4py.MPI initialises MPI, and a communicator exists only
    # once it is imported.
    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is not None and isinstance(comm, MPI.Intracomm) and comm != MPI.COMM_NULL:
        return
    r = repr(comm)
    r = r if len(r) <= 60 else r[:57] + "..."
    null = MPI is not None and isinstance(comm, MPI.Comm) and comm == MPI.COMM_NULL
    why = "MPI.COMM_NULL" if null else f"a {type(comm).__module__}.{type(comm).__qualname__}"
    raise InvalidArgumentError(
        f"{op}: comm = {r} is {why}; it must be an mpi4py communicator (mpi4py.MPI.Intracomm: "
        "MPI.COMM_WORLD, or one made by its Split / Create / Dup)")


def register_group(name: str, comm) -> str:
    """Gives an mpi4py communicator a name to pass as group_ep / group_tp. Collective over comm
    on its first use by an op (moe_ep.torch.group_id). Returns name. InvalidArgumentError for an
    empty name, one already given to another communicator, or a comm that is not an mpi4py
    intracommunicator (MPI.COMM_NULL included), before the name is taken."""
    if not isinstance(name, str) or not name:
        raise InvalidArgumentError(f"register_group: name = {name!r} must be a non-empty string")
    _check_comm("register_group", comm)
    if name in _named and _named[name] is not comm:
        raise InvalidArgumentError(f"register_group: name {name!r} names another communicator")
    _named[name] = comm
    _names[id(comm)] = name
    return name


def group_name(comm) -> str:
    """The name of an mpi4py communicator for group_ep / group_tp (the counterpart of torch_npu's
    get_hccl_comm_name), registering it under a new name on first use."""
    hit = _names.get(id(comm))
    if hit is not None and _named.get(hit) is comm:
        return hit
    _check_comm("group_name", comm)
    return register_group(f"moe_ep_group_{next(_counter)}", comm)


def _group(op: str, param: str, name, optional: bool = False):
    if optional and (name is None or name == ""):
        return None
    if not isinstance(name, str) or name not in _named:
        raise InvalidArgumentError(
            f"{op}: {param} = {name!r} is not a registered group name (use "
            "moe_ep.torch_npu.group_name(comm) or register_group(name, comm))"
        )
    return _named[name]


class _UnknownGroup:
    """group_tp given as a name no communicator has: handed to moe_ep.torch, whose front reports
    the error (front_error) through the collective over group_ep, so the peers raise RemoteError
    at once instead of waiting for this rank."""

    def __init__(self, error: InvalidArgumentError):
        self.front_error = error

    def py2f(self):  # moe_ep.torch.group_id's first step: raises the error
        raise self.front_error


def _tp_group(op: str, name):
    try:
        return _group(op, "group_tp", name, optional=True)
    except InvalidArgumentError as e:
        return _UnknownGroup(e)


def npu_moe_distribute_dispatch_v2(
    x: Tensor,
    expert_ids: Tensor,
    group_ep: str,
    ep_world_size: int,
    ep_rank_id: int,
    moe_expert_num: int,
    *,
    scales: Optional[Tensor] = None,
    x_active_mask: Optional[Tensor] = None,
    expert_scales: Optional[Tensor] = None,
    elastic_info: Optional[Tensor] = None,
    performance_info: Optional[Tensor] = None,
    group_tp: str = "",
    tp_world_size: int = 0,
    tp_rank_id: int = 0,
    expert_shard_type: int = 0,
    shared_expert_num: int = 1,
    shared_expert_rank_num: int = 0,
    quant_mode: int = 0,
    global_bs: int = 0,
    expert_token_nums_type: int = 1,
    comm_alg: str = "",
    zero_expert_num: int = 0,
    copy_expert_num: int = 0,
    const_expert_num: int = 0,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """torch_npu.npu_moe_distribute_dispatch_v2 (SPEC §1). Returns (expand_x, dynamic_scales,
    assist_info_for_combine, expert_token_nums, ep_recv_counts, tp_recv_counts,
    expand_scales)."""
    op = "npu_moe_distribute_dispatch_v2"
    ep = _group(op, "group_ep", group_ep)
    tp = _tp_group(op, group_tp)
    d = _mt.dispatch_v2(
        x, expert_ids, ep, ep_world_size, ep_rank_id, moe_expert_num, group_tp=tp,
        scales=scales, x_active_mask=x_active_mask, expert_scales=expert_scales,
        elastic_info=elastic_info, performance_info=performance_info,
        tp_world_size=tp_world_size, tp_rank_id=tp_rank_id, expert_shard_type=expert_shard_type,
        shared_expert_num=shared_expert_num, shared_expert_rank_num=shared_expert_rank_num,
        quant_mode=quant_mode, global_bs=global_bs, expert_token_nums_type=expert_token_nums_type,
        comm_alg=comm_alg, zero_expert_num=zero_expert_num, copy_expert_num=copy_expert_num,
        const_expert_num=const_expert_num,
    )
    counts = d.ep_recv_counts
    # A scale-in's handle is not one combine can take by default; under torch.compile the
    # tensors are traced values without an identity to key on (the compiled combine runs
    # without the plan: the same bits, its counts exchanged again).
    if elastic_info is None and not torch.compiler.is_compiling():
        _plans[id(counts)] = d.handle
        weakref.finalize(counts, _plans.pop, id(counts), None)
    return tuple(d)


def npu_moe_distribute_combine_v2(
    expand_x: Tensor,
    expert_ids: Tensor,
    assist_info_for_combine: Tensor,
    ep_send_counts: Tensor,
    expert_scales: Tensor,
    group_ep: str,
    ep_world_size: int,
    ep_rank_id: int,
    moe_expert_num: int,
    *,
    tp_send_counts: Optional[Tensor] = None,
    x_active_mask: Optional[Tensor] = None,
    expand_scales: Optional[Tensor] = None,
    shared_expert_x: Optional[Tensor] = None,
    elastic_info: Optional[Tensor] = None,
    ori_x: Optional[Tensor] = None,
    const_expert_alpha_1: Optional[Tensor] = None,
    const_expert_alpha_2: Optional[Tensor] = None,
    const_expert_v: Optional[Tensor] = None,
    performance_info: Optional[Tensor] = None,
    group_tp: str = "",
    tp_world_size: int = 0,
    tp_rank_id: int = 0,
    expert_shard_type: int = 0,
    shared_expert_num: int = 1,
    shared_expert_rank_num: int = 0,
    global_bs: int = 0,
    comm_quant_mode: int = 0,
    comm_alg: str = "",
    zero_expert_num: int = 0,
    copy_expert_num: int = 0,
    const_expert_num: int = 0,
) -> Tensor:
    """torch_npu.npu_moe_distribute_combine_v2 (SPEC §2). Returns x (BS, H). Without a TP group
    (tp_world_size < 2) tp_send_counts is not read, as torch_npu's own example passes
    dispatch's (1,) tp_recv_counts there (moe_ep.torch.combine_v2 refuses it)."""
    op = "npu_moe_distribute_combine_v2"
    if isinstance(tp_world_size, int) and not isinstance(tp_world_size, bool) and tp_world_size < 2:
        tp_send_counts = None  # a malformed tp_world_size is moe_ep.torch.combine_v2's error
    ep = _group(op, "group_ep", group_ep)
    tp = _tp_group(op, group_tp)
    handle = None
    if elastic_info is None and not torch.compiler.is_compiling():
        handle = _plans.get(id(ep_send_counts))
    return _mt.combine_v2(
        expand_x, expert_ids, assist_info_for_combine, ep_send_counts, expert_scales, ep,
        ep_world_size, ep_rank_id, moe_expert_num, group_tp=tp, tp_send_counts=tp_send_counts,
        x_active_mask=x_active_mask, expand_scales=expand_scales, shared_expert_x=shared_expert_x,
        elastic_info=elastic_info, ori_x=ori_x, const_expert_alpha_1=const_expert_alpha_1,
        const_expert_alpha_2=const_expert_alpha_2, const_expert_v=const_expert_v,
        performance_info=performance_info, tp_world_size=tp_world_size, tp_rank_id=tp_rank_id,
        expert_shard_type=expert_shard_type, shared_expert_num=shared_expert_num,
        shared_expert_rank_num=shared_expert_rank_num, global_bs=global_bs,
        comm_quant_mode=comm_quant_mode, comm_alg=comm_alg, zero_expert_num=zero_expert_num,
        copy_expert_num=copy_expert_num, const_expert_num=const_expert_num, handle=handle,
    )


def npu_moe_token_permute(
    tokens: Tensor, indices: Tensor, num_out_tokens: Optional[int] = None,
    padded_mode: bool = False,
) -> Tuple[Tensor, Tensor]:
    """torch_npu.npu_moe_token_permute (SPEC §4.1): (permuted_tokens, sorted_indices)."""
    return _mt.token_permute(tokens, indices, num_out_tokens, padded_mode)


def npu_moe_token_unpermute(
    permuted_tokens: Tensor, sorted_indices: Tensor, probs: Optional[Tensor] = None,
    padded_mode: bool = False, restore_shape=None,
) -> Tensor:
    """torch_npu.npu_moe_token_unpermute (SPEC §4.2)."""
    return _mt.token_unpermute(permuted_tokens, sorted_indices, probs, padded_mode, restore_shape)


def npu_moe_token_permute_grad(
    tokens: Tensor, grad_permuted_tokens: Tensor, indices: Tensor, sorted_indices: Tensor,
    padded_mode: bool = False,
) -> Tensor:
    """npu_moe_token_permute's backward (SPEC §4.3): grad_tokens."""
    return _mt.token_permute_grad(tokens, grad_permuted_tokens, indices, sorted_indices,
                                  padded_mode)


def npu_moe_token_unpermute_grad(
    permuted_tokens: Tensor, grad_out: Tensor, sorted_indices: Tensor,
    probs: Optional[Tensor] = None, padded_mode: bool = False, restore_shape=None,
) -> Tuple[Tensor, Tensor]:
    """npu_moe_token_unpermute's backward (SPEC §4.3): (grad_permuted_tokens, grad_probs)."""
    return _mt.token_unpermute_grad(permuted_tokens, grad_out, sorted_indices, probs,
                                    padded_mode, restore_shape)


# ---------------------------------------------------------------------------------------------
# torch_npu's device calls on CPU: the ported program's `.npu()`, `torch.npu.set_device`,
# `torch.npu.synchronize`, ... run unchanged and do nothing (tensors stay on the CPU, where every
# op runs synchronously).


def _device_index(op: str, device) -> int:
    """set_device's device: an int >= 0, "npu" / "npu:N", or None (0)."""
    if device is None:
        return 0
    if isinstance(device, str):
        kind, _, idx = device.partition(":")
        if kind == "npu" and (not idx or idx.isdigit()):
            return int(idx) if idx else 0
    elif not isinstance(device, bool) and hasattr(device, "__index__") and device.__index__() >= 0:
        return device.__index__()
    raise InvalidArgumentError(
        f"{op}: device = {device!r} ({type(device).__name__}) must be an int >= 0, 'npu' or "
        "'npu:N'")


def _local_ranks() -> int:
    """The processes of this job on this machine, as the launchers state them (no MPI call)."""
    import os

    for var in ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "MPI_LOCAL_NRANKS",
                "LOCAL_WORLD_SIZE"):
        v = os.environ.get(var, "")
        if v.isdigit() and int(v) > 0:
            return int(v)
    return 1


class _Event:
    """torch.npu.Event: recorded at once (CPU ops have finished when they return);
    elapsed_time is the wall time between two records, in milliseconds."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False):
        self.enable_timing = enable_timing
        self._t: Optional[float] = None

    def record(self, stream=None) -> None:
        import time

        self._t = time.perf_counter()

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end_event: "_Event") -> float:
        if self._t is None or end_event._t is None:
            raise InvalidArgumentError(
                "npu.Event.elapsed_time: both events must be recorded first (record())")
        return (end_event._t - self._t) * 1000.0


class _Stream:
    """torch.npu.Stream: the one CPU stream; every wait is already satisfied."""

    def __init__(self, device=None, priority: int = 0, **kwargs):
        self.device = device

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def record_event(self, event=None) -> _Event:
        event = event if event is not None else _Event()
        event.record(self)
        return event

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None


class _Npu:
    """torch_npu's device module (torch_npu.npu, torch.npu) on CPU. Decisions:
    is_available() is True (the program was written for NPUs: its NPU branch is the one that
    runs, and its calls below work); device_count() is the job's ranks on this machine (Open MPI's
    OMPI_COMM_WORLD_LOCAL_SIZE, MPICH's MPI_LOCALNRANKS, torchrun's LOCAL_WORLD_SIZE; else 1),
    as torch_npu counts the NPUs of the machine, one per rank; set_device records the index that
    current_device() returns (0 before any) and binds nothing; synchronize, empty_cache and the
    streams and events do nothing (CPU ops are done when they return); manual_seed(_all) do
    nothing, as torch_npu's seed only the NPU generators, not the CPU one the tensors here come
    from. torch.device("npu") and tensor.to("npu") are torch's and still fail on CPU torch."""

    Event = _Event
    Stream = _Stream

    def __init__(self):
        self._device = 0
        self._stream = _Stream()

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def device_count(self) -> int:
        return _local_ranks()

    def set_device(self, device) -> None:
        self._device = _device_index("npu.set_device", device)

    def current_device(self) -> int:
        return self._device

    def synchronize(self, device=None) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        pass

    def manual_seed_all(self, seed: int) -> None:
        pass

    def current_stream(self, device=None) -> _Stream:
        return self._stream

    def default_stream(self, device=None) -> _Stream:
        return self._stream

    def stream(self, stream=None):
        import contextlib

        return contextlib.nullcontext(stream)


npu = _Npu()


def _same(self, *args, **kwargs):
    """`.npu()` on CPU: the object itself (tensors and modules stay on the CPU)."""
    return self


# Only on a machine without the real torch_npu (which registers torch.npu and Tensor.npu itself,
# and refuses to when they exist), and only where torch itself lacks them.
if importlib.util.find_spec("torch_npu") is None:
    if not hasattr(torch.Tensor, "npu"):
        torch.Tensor.npu = _same
    if not hasattr(torch.nn.Module, "npu"):
        torch.nn.Module.npu = _same
    if not hasattr(torch, "npu"):
        torch.npu = npu

__all__ = [
    "group_name",
    "npu",
    "npu_moe_distribute_combine_v2",
    "npu_moe_distribute_dispatch_v2",
    "npu_moe_token_permute",
    "npu_moe_token_permute_grad",
    "npu_moe_token_unpermute",
    "npu_moe_token_unpermute_grad",
    "register_group",
]
