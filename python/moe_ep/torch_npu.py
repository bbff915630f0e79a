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
importing this module makes ``Tensor.npu()`` return the tensor itself and ``npu.set_device`` do
nothing, when torch has no NPU support of its own, so that the ported program's device calls
need no edit.

One addition, invisible to the caller: npu_moe_distribute_dispatch_v2 keeps its plan (SPEC §7)
with the ep_recv_counts tensor it returned, and npu_moe_distribute_combine_v2 given that very
tensor as ep_send_counts uses it, so that only the rows travel back (the same bits) and the pair
is differentiable (SPEC §6).
"""

from __future__ import annotations

import itertools
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


def register_group(name: str, comm) -> str:
    """Gives an mpi4py communicator a name to pass as group_ep / group_tp. Collective over comm
    on its first use by an op (moe_ep.torch.group_id). Returns name. InvalidArgumentError for an
    empty name or one already given to another communicator."""
    if not isinstance(name, str) or not name:
        raise InvalidArgumentError(f"register_group: name = {name!r} must be a non-empty string")
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
    if elastic_info is None:  # a scale-in's handle is not one combine can take by default
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
    handle = _plans.get(id(ep_send_counts)) if elastic_info is None else None
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


class _Npu:
    """torch_npu.npu's device calls, as no-ops on CPU."""

    @staticmethod
    def set_device(device) -> None:
        del device

    @staticmethod
    def synchronize(device=None) -> None:
        del device


npu = _Npu()

if not hasattr(torch.Tensor, "npu"):  # CPU torch: .npu() keeps the tensor where it is
    torch.Tensor.npu = lambda self, *args, **kwargs: self

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
