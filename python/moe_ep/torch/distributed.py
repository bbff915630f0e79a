"""SPEC §1-2 from Python: dispatch_v2 / combine_v2 on torch CPU tensors over MPI, and their size
query dispatch_workspace.

The communicators are mpi4py communicators (default MPI.COMM_WORLD); start the processes with
mpirun. The torch custom ops ``torch.ops.moe_ep.dispatch_v2`` / ``combine_v2`` take the
communicator as an integer group id (a custom op cannot take a Python object): ``group_id(comm)``
gives it, and the wrappers ``dispatch_v2`` / ``combine_v2`` below take the mpi4py communicator
itself, with the SPEC's argument names and defaults.

The first use of an mpi4py communicator duplicates it (MPI_Comm_idup, waited on with the
deadline: collective, so every rank must make its first call on it at the same point, as the ops
themselves require); later uses of the same communicator reuse the duplicate.
``release_group(comm)`` frees it.

Both ops are collective over group_ep: every rank calls them in the same order. A bad argument on
one rank raises moe_ep.InvalidArgumentError there and moe_ep.RemoteError on the others, whatever
its kind (a malformed type or size the Python front finds goes into the collective call as that
rank's caller_error, so no rank waits for its deadline); every wait
has a deadline (moe_ep.TimeoutError; $MOE_EP_TIMEOUT_S, default 300 s). After a TimeoutError the
communicator is unusable (messages of the abandoned call may still arrive): release_group(comm)
on every rank, or use another communicator. After a TimeoutError or SystemError the
interpreter's exit is bounded: MPI_Finalize waits for every process of the job, a stalled one
included, so a process still exiting $MOE_EP_EXIT_GRACE_S seconds (default 2) after its exit
began ends itself with status 1, naming the first error on stderr, and mpirun ends the job.

Autograd (SPEC §6): through the wrappers without performance_info, x gets its gradient from
dispatch_v2, and expand_x, expert_scales, shared_expert_x, ori_x and the const tables from
combine_v2, by the collective custom ops dispatch_v2_backward / combine_v2_backward (so every
rank must run the backward, in the same order, as it ran the forward: keep every rank's graph
the same shape, e.g. run each local expert on its slice of expand_x even when it is empty, so
that no rank's graph skips dispatch_v2's backward). combine_v2's backward
needs handle= (the .handle of its dispatch_v2): without it, InvalidArgumentError when the
gradient is taken. quant_mode 2 and comm_quant_mode 2 (int8 rows) have no gradient: with grad
mode on and an input that requires grad, the forward raises UnsupportedError (run it under
torch.no_grad(), or on detached tensors).
The fake implementations give the SPEC §1.4 output shapes, so torch.compile can trace a layer that
calls them (not with elastic_info, whose output shapes depend on the table's values). The wrappers
trace too, fullgraph included, given an mpi4py communicator: torch.compile cannot trace into
mpi4py, so its group id is resolved while tracing (group_id, run for real, its result a constant
of the graph; the first use of a communicator, collective, then happens during the trace, which
every rank runs at the same point). After release_group(comm), call torch._dynamo.reset().
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import inspect
import itertools
import threading
import weakref
from typing import Dict, NamedTuple, List, Optional, Tuple

import torch
from torch import Tensor

from moe_ep import Error, InvalidArgumentError, UnsupportedError, _C
from moe_ep.torch import _args
from moe_ep.torch._convert import dl, dtype_name, tt
from moe_ep.torch.ops import _ndim

# ---------------------------------------------------------------------------------------------
# Communicators.

# Plain Python containers, so that torch.compile traces the lookup in _resolve (it cannot trace
# mpi4py's py2f nor the nanobind Communicator's properties).
_groups: Dict[int, "_C.Communicator"] = {}  # group id -> moe-ep's duplicate
_size_rank: Dict[int, Tuple[int, int]] = {}  # group id -> (size, rank)
# id(mpi4py communicator) -> (the communicator, its Fortran handle, group id). Keyed by the
# object, not by the handle: MPI reuses handles after Free(), and a reused handle may name a
# communicator with other members. The reference keeps the id from being reused.
_by_object: Dict[int, Tuple[object, int, int]] = {}
_next_id = itertools.count(1)
# Group ids registered by dispatch_workspace's first use of a communicator and not yet used by an
# op: group_id(comm, ...) may still give such a communicator its options (it is duplicated again),
# so that the documented order (query the sizes, then register the window) works on one comm.
_query_only: set = set()


@atexit.register
def _free_groups() -> None:
    # Python's atexit handlers run before mpi4py finalises MPI (mpi4py's MPI_Finalize is a C-level
    # Py_AtExit function): free the duplicates while MPI is still up. After a Timeout or System
    # error, MPI_Finalize may wait forever for a stalled or dead peer: the guard ends the
    # process $MOE_EP_EXIT_GRACE_S seconds from now if it still runs (status 1, the first error
    # named on stderr); mpirun then ends the job.
    _C._arm_exit_guard()
    _by_object.clear()
    _size_rank.clear()
    _groups.clear()


def _world():
    from mpi4py import MPI  # initialises MPI when not yet done

    return MPI.COMM_WORLD


def group_id(
    comm=None,
    timeout_s: Optional[float] = None,
    shm_window_bytes: Optional[int] = None,
    shm_grow: Optional[bool] = None,
) -> int:
    """The group id of an mpi4py communicator (None: MPI.COMM_WORLD) for the torch custom ops.

    The first call for a communicator object duplicates it (MPI_Comm_dup: collective over it, so
    every rank makes that call at the same point); later calls with the same object return the
    same id. A group id (int) is returned as it is if registered. Calls on one communicator must
    not overlap (threads): use one communicator per thread.

    The options are moe_ep::CommOptions (include/moe_ep/comm.h), fixed by the first call: a later
    call (with the communicator or its group id) that passes a different value raises
    InvalidArgumentError naming the option, the value and the registered one; None leaves the
    registered value as it is. One exception: a communicator registered by dispatch_workspace
    and not yet used by an op is registered again with the options given (MPI_Comm_dup:
    collective, every rank at the same point), so the sizes can be queried on the communicator
    whose window they size.
    timeout_s: the deadline of every wait of the ops on it, in seconds (> 0; None: default
    $MOE_EP_TIMEOUT_S, else 300).
    shm_window_bytes: the shared-memory transport's window, in bytes: this rank's segment when
    the first op that uses the window creates it (>= 0; None or 0: twice that op's need, at least
    1 MiB). Size it with dispatch_workspace(): n * shm_slot_bytes + shm_stage_bytes holds n
    dispatch_v2 outputs alive at once and a combine_v2, so that no call grows the window (a call
    that needs more still grows it).
    shm_grow: whether ops may create and grow the window (None or True). False: the window is
    made now, collectively, with shm_window_bytes (> 0) per rank, and no op grows it: a call
    without room in a receiver's window moves its rows by messages. Every rank passes the same.

    Errors: InvalidArgumentError for an unregistered group id, an object that is not an mpi4py
    communicator, an option that differs from the registered one, a bad timeout_s (or
    $MOE_EP_TIMEOUT_S), a shm_window_bytes that is negative or above this machine's physical
    memory, and shm_grow False without a shm_window_bytes (on every rank: ranks that disagree on
    shm_grow). The bad values are checked on this rank
    before the duplication: when every rank passes the same value, every rank raises and none
    is left waiting; a rank that raises alone (or never calls) leaves the others waiting in the
    duplication until their deadline (TimeoutError)."""
    if shm_grow is not None and not isinstance(shm_grow, bool):
        raise InvalidArgumentError(f"group_id: shm_grow = {shm_grow!r} must be True, False or None")
    if comm is None:
        comm = _world()
    if isinstance(comm, int):
        if comm not in _groups:
            raise _unregistered("group_id", "comm", comm)
        _check_options(comm, timeout_s, shm_window_bytes, shm_grow)
        return comm
    try:
        handle = comm.py2f()
    except AttributeError:
        raise InvalidArgumentError(
            f"group_id: comm = {comm!r} is not an mpi4py communicator (or a group id)"
        ) from None
    hit = _by_object.get(id(comm))
    if hit is not None and hit[0] is comm:
        _, old_handle, gid = hit
        if old_handle == handle:
            unset = timeout_s is None and shm_window_bytes is None and shm_grow is None
            if gid not in _query_only or unset:
                _check_options(gid, timeout_s, shm_window_bytes, shm_grow)
                return gid
            # only dispatch_workspace used it: registered again below with these options
            # (collective, like its first registration)
        release_group(gid)  # the object was freed (Free()) and now holds another handle
    # shm_window_bytes < 0 is refused by moe_ep::Communicator::from_mpi (before MPI_Comm_dup)
    g = _C.Communicator.from_fortran(
        handle,
        timeout_s,
        0 if shm_window_bytes is None else shm_window_bytes,
        True if shm_grow is None else bool(shm_grow),
    )
    gid = next(_next_id)
    _groups[gid] = g
    _size_rank[gid] = (g.size, g.rank)
    _by_object[id(comm)] = (comm, handle, gid)
    return gid


def _check_options(
    gid: int,
    timeout_s: Optional[float],
    shm_window_bytes: Optional[int],
    shm_grow: Optional[bool] = None,
) -> None:
    """A registered communicator's options stay those of its first group_id call."""
    if timeout_s is None and shm_window_bytes is None and shm_grow is None:
        return  # no property reads: _resolve's lookups stay plain Python for torch.compile
    g = _groups[gid]
    for name, value, have, unit in (
        ("timeout_s", timeout_s, g.timeout_s, " s"),
        ("shm_window_bytes", shm_window_bytes, g.shm_window_bytes, " bytes"),
        ("shm_grow", shm_grow, g.shm_grow, ""),
    ):
        if value is not None and value != have:
            raise InvalidArgumentError(
                f"group_id: {name} = {value} differs from the {have}{unit} this "
                "communicator was registered with (release_group it first, on every rank)"
            )


def release_group(comm) -> None:
    """Frees moe-ep's duplicate of an mpi4py communicator (or of a group id). Local, but the next
    use of the communicator duplicates it again, which is collective: release on every rank at
    the same point."""
    if isinstance(comm, int):
        gid = comm
    else:
        hit = _by_object.get(id(comm))
        gid = hit[2] if hit is not None and hit[0] is comm else None
    if gid is None:
        return
    _groups.pop(gid, None)
    _size_rank.pop(gid, None)
    _query_only.discard(gid)
    for key in [k for k, (_, _, g) in _by_object.items() if g == gid]:
        del _by_object[key]


def _traced_group_id(comm) -> int:
    """group_id(comm) while torch.compile traces: Dynamo calls it with the real communicator
    (guarded by identity: another communicator object retraces) and bakes the id into the graph
    as a constant, so a compiled layer may make the first use of a communicator (collective: every
    rank traces the same code at the same point) without tracing into mpi4py (py2f). After
    release_group(comm), reset the compiled code (torch._dynamo.reset()): its id is released."""
    return group_id(comm)


# What torch.compiler.assume_constant_result(_traced_group_id) does in PyTorch 2.13, without
# importing torch._dynamo (seconds) into every process that imports moe_ep.torch.
_traced_group_id._dynamo_marked_constant = True


def _unregistered(op: str, param: str, gid: int) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"{op}: {param} = {gid} is not a registered group id (pass the mpi4py communicator "
        "itself, or the id moe_ep.torch.group_id(comm) returned for it, not released since)")


def _resolve(comm, op: str = "group_id", param: str = "comm") -> Tuple[int, int, int]:
    """(group id, size, rank) of an mpi4py communicator (None: MPI.COMM_WORLD) or a group id.
    A registered communicator is found by identity, a lookup torch.compile can trace; the first
    use of one goes through group_id (collective; under torch.compile, _traced_group_id). An
    unregistered group id is an InvalidArgumentError naming op and param."""
    if isinstance(comm, int):
        gid = comm
    elif torch.compiler.is_compiling():
        gid = _traced_group_id(comm)
    else:
        if comm is None:
            comm = _world()
        hit = _by_object.get(id(comm))
        gid = hit[2] if hit is not None and hit[0] is comm else group_id(comm)
    if gid not in _size_rank:
        raise _unregistered(op, param, gid)
    size, rank = _size_rank[gid]
    return gid, size, rank


def _group(op: str, param: str, gid: int):
    try:
        return _groups[gid]
    except KeyError:
        raise _unregistered(op, param, gid) from None


def _binding_args(op: str, args: Dict[str, object]) -> Dict[str, object]:
    """The custom op's arguments as moe_ep._C takes them: group ids as communicators (group_tp 0:
    none), tensors through dl(); performance_info is written in place, so it goes as it is."""
    out: Dict[str, object] = {}
    for name, value in args.items():
        if name == "group_ep" or (name == "group_tp" and value):
            out[name] = _group(op, name, value)
            _query_only.discard(value)  # used by an op: its options are now fixed
        elif name == "group_tp":
            out[name] = None
        elif name == "handle":
            continue  # the caller resolves it (_handle_of)
        elif isinstance(value, Tensor) and name != "performance_info":
            # Not dl(value, op, name): a dtype the binding cannot take must reach the op as this
            # rank's caller_error (the binding does that), so the peers raise RemoteError at
            # once instead of waiting for a rank that raised here until their deadline.
            out[name] = dl(value)
        else:
            out[name] = value
    return out


# ---------------------------------------------------------------------------------------------
# Argument checks of the collective ops. A malformed argument (None or a list for a tensor, a
# float or a bool for an int, an unknown keyword, outputs beyond the size bound) is found before
# the op and still goes into the collective call, as this rank's caller_error (the binding's
# handle_error and caller_error_kind, with placeholder tensors): this rank raises it, every peer
# raises RemoteError naming this rank and the cause at once, instead of waiting for a rank that
# never came until its deadline.

_KINDS = {
    "Tensor": _args.tensor,
    "Optional[Tensor]": lambda op, name, v: _args.tensor(op, name, v, optional=True),
    "int": _args.integer,
    "Optional[int]": lambda op, name, v: _args.integer(op, name, v, optional=True),
    "bool": _args.boolean,
    "str": _args.string,
}
_GROUPS = ("group_ep", "group_tp")  # resolved by the wrappers (communicators or group ids)


@functools.lru_cache(maxsize=None)
def _annotations(impl) -> Dict[str, str]:
    return {n: str(p.annotation) for n, p in inspect.signature(impl).parameters.items()}


def _arg_error(op: str, impl, values: Dict[str, object]) -> Optional[Error]:
    """The first malformed argument of values (by impl's annotations) as an error naming op,
    parameter, value and expected type; None when every one is well-formed."""
    params = _annotations(impl)
    try:
        for name, value in values.items():
            if name in _GROUPS:
                continue
            if name not in params:
                raise InvalidArgumentError(
                    f"{op}: {name} is not a keyword argument of {op} (SPEC's names: "
                    f"{', '.join(p for p in params if p not in _GROUPS)})"
                )
            _KINDS[params[name]](op, name, value)
        _tensor_errors(op, values)
        for name, value in values.items():
            _args.in_bytes(op, name, value)
        made = 0
        if op == "dispatch_v2":
            made = _dispatch_out_bytes(values)
        elif op == "combine_v2":
            made = _combine_out_bytes(values)
        _args.working_set(op, {k: v for k, v in values.items() if isinstance(v, Tensor)}, made)
    except Error as e:
        return e
    return None


_FLOATS = (torch.bfloat16, torch.float16, torch.float32)
# The dtypes each tensor argument of the collective ops takes (the C++ checks, src/core/ep/): the
# binding converts only bf16, fp16, fp32, int8, int32, int64 and bool, and would name those.
_TENSOR_DTYPES = {
    "x": _FLOATS, "expand_x": _FLOATS, "grad_expand_x": _FLOATS, "grad_out": _FLOATS,
    "shared_expert_x": _FLOATS, "ori_x": _FLOATS, "const_expert_alpha_1": _FLOATS,
    "const_expert_alpha_2": _FLOATS, "const_expert_v": _FLOATS,  # expand_x's dtype
    "expert_ids": (torch.int32,), "assist_info_for_combine": (torch.int32,),
    "ep_send_counts": (torch.int32,), "tp_send_counts": (torch.int32,),
    "elastic_info": (torch.int32,), "performance_info": (torch.int64,),
    "scales": (torch.float32,), "expert_scales": (torch.float32,),
    "expand_scales": (torch.float32,), "x_active_mask": (torch.bool,),
}
_CONVERTIBLE = (*_FLOATS, torch.int8, torch.int32, torch.int64, torch.bool)


def _tensor_errors(op: str, values: Dict[str, object]) -> None:
    """Raises what the C++ checks would say less usefully: int64 expert_ids (torch.topk's
    indices) with the .int() hint; a dtype the binding cannot convert, with the dtypes this
    parameter takes; combine_v2 with neither a handle nor dispatch_v2's layout tensors."""
    for name, value in values.items():
        if not isinstance(value, Tensor) or name not in _TENSOR_DTYPES:
            continue
        allowed = _TENSOR_DTYPES[name]
        if name == "expert_ids" and value.dtype == torch.int64:
            raise InvalidArgumentError(
                f"{op}: expert_ids dtype torch.int64 is not one of {{torch.int32}} "
                "(torch.topk returns int64 indices: pass expert_ids.int())")
        if value.dtype not in _CONVERTIBLE:
            raise UnsupportedError(
                f"{op}: {name} dtype {value.dtype} is not one of "
                f"{', '.join(str(d) for d in allowed)}"
                + (" (expand_x's)" if name in ("shared_expert_x", "ori_x") or
                   name.startswith("const_expert") else ""))
    if op == "combine_v2" and values.get("handle") is None:
        missing = [n for n in ("assist_info_for_combine", "ep_send_counts")
                   if values.get(n) is None]
        if missing:
            raise InvalidArgumentError(
                f"combine_v2: {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
                "None and no handle is given: combine_v2 needs either handle= (the .handle of "
                "the dispatch_v2 these rows came from) or that dispatch_v2's "
                "assist_info_for_combine and ep_recv_counts (as ep_send_counts)")


def _combine_out_bytes(v: Dict[str, object]) -> int:
    """combine_v2's x (BS, H) within the bound; its bytes."""
    y, ids = v["expand_x"], v["expert_ids"]
    if y.dim() != 2 or ids.dim() < 1:
        return 0
    return _args.out_bytes("combine_v2", "x (BS, H)", (ids.shape[0], y.shape[1]), y.dtype)


def _dispatch_out_bytes(v: Dict[str, object]) -> int:
    """expand_x's (max(1,T)*A, H) and assist_info_for_combine's max(BS*K, A*128) entries within
    the bound (SPEC §1.4), before the op allocates them; a placement the C++ checks refuse is left
    to them. Returns the outputs' bytes."""
    x, ids = v["x"], v["expert_ids"]
    if x.dim() != 2 or ids.dim() != 2:
        return 0
    try:
        a, _, t = _dispatch_shapes(
            ids.shape[0], ids.shape[1], v["ep_world_size"], v["ep_rank_id"], v["moe_expert_num"],
            v.get("tp_world_size", 0),
            v.get("shared_expert_num", 1) if v.get("shared_expert_rank_num", 0) > 0 else 0,
            v.get("shared_expert_rank_num", 0), v.get("global_bs", 0))
    except (InvalidArgumentError, ZeroDivisionError):
        return 0
    quant = v.get("quant_mode", 0) == 2
    made = _args.out_bytes("dispatch_v2", "expand_x (max(1, tp_world_size) * A, H)",
                           (t * a, x.shape[1]), torch.int8 if quant else x.dtype)
    made += _args.out_bytes("dispatch_v2", "assist_info_for_combine (max(BS * K, A * 128),)",
                            (max(ids.shape[0] * ids.shape[1], a * 128),), torch.int32)
    return made + 4 * t * a  # expand_scales (fp32)


def _raise_in_collective(op: str, err: Error, gid: int, group_tp: int, tp_world_size) -> None:
    """Enters op's collective with err as this rank's caller_error and placeholder tensors; the
    binding raises err here and RemoteError on the peers."""
    comm = _group(op, "group_ep", gid)
    size, rank = _size_rank[gid]
    tp = _groups.get(group_tp) if isinstance(group_tp, int) and group_tp else None
    tp_size = tp_world_size if isinstance(tp_world_size, int) and tp is not None else 0
    f32, i32 = torch.empty((0, 1)), torch.empty((0, 1), dtype=torch.int32)
    ep = dict(group_ep=comm, ep_world_size=size, ep_rank_id=rank, moe_expert_num=0, group_tp=tp,
              tp_world_size=tp_size, tp_rank_id=tp.rank if tp is not None else 0,
              handle_error=str(err), caller_error_kind=err.kind)
    if op == "dispatch_v2":
        _C.dispatch_v2(f32, i32, **ep)
    elif op == "combine_v2":
        _C.combine_v2(f32, i32, None, None, f32, **ep)
    elif op == "dispatch_v2_backward":
        _C.dispatch_v2_backward(f32, i32, **ep)
    else:
        _C.combine_v2_backward(f32, f32, i32, f32, **ep)
    raise err  # not reached: the binding raises err


# The op whose arguments the public wrapper has just checked (_front_checks): its custom op's
# implementation, called by that wrapper on this thread, need not check them again (the checks
# are most of a small call's cost in Python). Direct calls of torch.ops.moe_ep.* still check.
_front_checked = threading.local()


@contextlib.contextmanager
def _checked_by_front(op: str):
    if torch.compiler.is_compiling():  # the compiled graph's op runs later: it checks itself
        yield
        return
    _front_checked.op = op
    try:
        yield
    finally:
        _front_checked.op = None


def _checked(op: str, impl, values: Dict[str, object], gid: int) -> None:
    """Raises the first malformed argument of values, through op's collective (see above)."""
    if getattr(_front_checked, "op", None) == op:
        _front_checked.op = None  # once: the wrapper's call of the op
        return
    err = _arg_error(op, impl, values)
    if err is not None:
        _raise_in_collective(op, err, gid, values.get("group_tp", 0), values.get("tp_world_size"))


# ---------------------------------------------------------------------------------------------
# Output shapes (SPEC §1.4), for the fake implementations.


def _dispatch_shapes(
    bs: int,
    k: int,
    ep_world_size: int,
    ep_rank_id: int,
    moe_expert_num: int,
    tp_world_size: int,
    shared_expert_num: int,
    shared_expert_rank_num: int,
    global_bs: int,
):
    w, s, ns, e = ep_world_size, shared_expert_rank_num, shared_expert_num, moe_expert_num
    if w < 1 or not 0 <= s < w or e < 1 or (s > 0 and (ns < 1 or s % ns)):
        raise InvalidArgumentError(
            f"dispatch_v2: ep_world_size = {w}, shared_expert_rank_num = {s}, "
            f"shared_expert_num = {ns}, moe_expert_num = {e} do not form a valid placement"
        )
    g = global_bs if global_bs else bs * w
    if ep_rank_id < s:
        local = 1
        a = (g // w) * -(-w // (s // ns))
    else:
        local = e // (w - s)
        a = g * min(local, k)
    t = max(1, tp_world_size)
    return a, local, t


# ---------------------------------------------------------------------------------------------
# The dispatch handle (SPEC §7) as the torch ops carry it: a (1,) int64 tensor holding an id of
# the registry below, so that it flows through torch.compile graphs like any output. The plan
# lives as long as that tensor: its entry is dropped when the tensor is freed.

_handles: Dict[int, object] = {}
_next_handle = itertools.count(1)


def _handle_tensor(handle) -> Tensor:
    hid = next(_next_handle)
    t = torch.tensor([hid], dtype=torch.int64)
    _handles[hid] = handle
    weakref.finalize(t, _handles.pop, hid, None)
    return t


def _handle_of(op: str, t: Optional[Tensor]) -> Tuple[object, str]:
    """(the plan named by t, "") or (None, the reason it names none): a bad handle is reported
    inside the collective, as this rank's argument error, so the peers are not left waiting."""
    if t is None:
        return None, ""
    if not isinstance(t, Tensor) or t.dtype != torch.int64 or t.numel() != 1:
        got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, Tensor) else type(t).__name__
        return None, (f"{op}: handle must be the handle tensor dispatch_v2 returned ((1,) int64), "
                      f"got {got}")
    hid = int(t.reshape(-1)[0])
    h = _handles.get(hid)
    if h is None:
        return None, (f"{op}: handle {hid} names no live dispatch_v2 plan (the handle tensor "
                      "dispatch_v2 returned must be passed itself, and kept alive)")
    return h, ""


# ---------------------------------------------------------------------------------------------
# dispatch_v2


def _dispatch_v2_impl(
    x: Tensor,
    expert_ids: Tensor,
    group_ep: int,
    ep_world_size: int,
    ep_rank_id: int,
    moe_expert_num: int,
    scales: Optional[Tensor] = None,
    x_active_mask: Optional[Tensor] = None,
    expert_scales: Optional[Tensor] = None,
    elastic_info: Optional[Tensor] = None,
    performance_info: Optional[Tensor] = None,
    group_tp: int = 0,
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
    transport: str = "",
    exact_size: bool = False,
    handle: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    _checked("dispatch_v2", _dispatch_v2_impl, dict(locals()), group_ep)
    args = _binding_args("dispatch_v2", locals())
    args["handle"], args["handle_error"] = _handle_of("dispatch_v2", handle)
    expand_x, dynamic_scales, *rest, plan = _C.dispatch_v2(**args)
    if dynamic_scales is None:  # quant_mode 0: empty, as torch_npu returns
        dynamic_scales = torch.empty((0,), dtype=torch.float32)
    else:
        dynamic_scales = tt(dynamic_scales)
    return (tt(expand_x), dynamic_scales, *(tt(r) for r in rest), _handle_tensor(plan))


_dispatch_v2_op = torch.library.custom_op(
    "moe_ep::dispatch_v2", _dispatch_v2_impl, mutates_args=("performance_info",)
)


@_dispatch_v2_op.register_fake
def _(*args, **kwargs):
    bound = inspect.signature(_dispatch_v2_impl).bind(*args, **kwargs)
    bound.apply_defaults()
    return _dispatch_v2_fake(**bound.arguments)


def _dispatch_v2_fake(
    x, expert_ids, ep_world_size, ep_rank_id, moe_expert_num, elastic_info, tp_world_size,
    shared_expert_num, shared_expert_rank_num, quant_mode, global_bs, exact_size, **_
):
    _ndim("dispatch_v2", "x", x, 2)
    _ndim("dispatch_v2", "expert_ids", expert_ids, 2)
    if elastic_info is not None:
        raise UnsupportedError(
            "dispatch_v2: elastic_info cannot be traced (the output shapes depend on its values)"
        )
    bs, k = expert_ids.shape[0], expert_ids.shape[1]
    ns = shared_expert_num if shared_expert_rank_num > 0 else 0
    a, local, t = _dispatch_shapes(
        bs,
        k,
        ep_world_size,
        ep_rank_id,
        moe_expert_num,
        tp_world_size,
        ns,
        shared_expert_rank_num,
        global_bs,
    )
    h = x.shape[1]
    f32, i32 = torch.float32, torch.int32
    # exact_size: the rows this rank receives, known only when the op runs (a data-dependent
    # size; torch.compile traces it as an unbacked symbol, at most A).
    rows = t * a
    if exact_size:  # the bound only when it is a plain int (not symbolic in BS)
        rows = torch.library.get_ctx().new_dynamic_size(max=rows if isinstance(rows, int) else None)
    return (
        x.new_empty((rows, h), dtype=torch.int8 if quant_mode == 2 else x.dtype),
        x.new_empty((rows,) if quant_mode == 2 else (0,), dtype=f32),
        x.new_empty((3 * rows if exact_size else max(bs * k, a * 128),), dtype=i32),
        x.new_empty((local,), dtype=torch.int64),
        x.new_empty((ep_world_size * local * t,), dtype=i32),
        x.new_empty((t,), dtype=i32),
        x.new_empty((rows,), dtype=f32),
        x.new_empty((1,), dtype=torch.int64),
    )


# ---------------------------------------------------------------------------------------------
# combine_v2


def _combine_v2_impl(
    expand_x: Tensor,
    expert_ids: Tensor,
    assist_info_for_combine: Optional[Tensor],
    ep_send_counts: Optional[Tensor],
    expert_scales: Tensor,
    group_ep: int,
    ep_world_size: int,
    ep_rank_id: int,
    moe_expert_num: int,
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
    group_tp: int = 0,
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
    transport: str = "",
    exact_size: bool = False,
    handle: Optional[Tensor] = None,
) -> Tensor:
    _checked("combine_v2", _combine_v2_impl, dict(locals()), group_ep)
    args = _binding_args("combine_v2", locals())
    args["handle"], args["handle_error"] = _handle_of("combine_v2", handle)
    return tt(_C.combine_v2(**args))


def _combine_v2_fake(
    expand_x, expert_ids, assist_info_for_combine, ep_send_counts, expert_scales, *args, **kw
):
    _ndim("combine_v2", "expand_x", expand_x, 2)
    _ndim("combine_v2", "expert_ids", expert_ids, 2)
    return expand_x.new_empty((expert_ids.shape[0], expand_x.shape[1]))


_combine_v2_op = torch.library.custom_op(
    "moe_ep::combine_v2", _combine_v2_impl, mutates_args=("performance_info",)
)
_combine_v2_op.register_fake(_combine_v2_fake)
# The same op without the in-place performance_info (which must be None): what the wrapper calls
# when no performance_info is given. PyTorch 2.13's inductor fails on an op that returns a single
# tensor and declares a mutated argument ("getitem is not an OpOverload"), even when that
# argument is None; a functional op compiles with every backend.
_combine_v2_functional = torch.library.custom_op(
    "moe_ep::_combine_v2_functional", _combine_v2_impl, mutates_args=()
)
_combine_v2_functional.register_fake(_combine_v2_fake)
# dispatch_v2 likewise without performance_info: autograd can be registered only on a functional
# op, and this is the one the wrapper calls when no performance_info is given.
_dispatch_v2_functional = torch.library.custom_op(
    "moe_ep::_dispatch_v2_functional", _dispatch_v2_impl, mutates_args=()
)


@_dispatch_v2_functional.register_fake
def _(*args, **kwargs):
    bound = inspect.signature(_dispatch_v2_impl).bind(*args, **kwargs)
    bound.apply_defaults()
    return _dispatch_v2_fake(**bound.arguments)


# ---------------------------------------------------------------------------------------------
# The backward ops (SPEC §6, include/moe_ep/backward.h), and autograd for the functional forward
# ops through them. Each takes the forward's EP arguments and its handle tensor.

_EP_ARGS = (
    "group_tp", "tp_world_size", "tp_rank_id", "expert_shard_type", "shared_expert_num",
    "shared_expert_rank_num", "global_bs", "comm_alg", "zero_expert_num", "copy_expert_num",
    "const_expert_num", "transport", "exact_size",
)


def _dispatch_v2_backward_impl(
    grad_expand_x: Tensor,
    expert_ids: Tensor,
    group_ep: int,
    ep_world_size: int,
    ep_rank_id: int,
    moe_expert_num: int,
    x_active_mask: Optional[Tensor] = None,
    group_tp: int = 0,
    tp_world_size: int = 0,
    tp_rank_id: int = 0,
    expert_shard_type: int = 0,
    shared_expert_num: int = 1,
    shared_expert_rank_num: int = 0,
    global_bs: int = 0,
    comm_alg: str = "",
    zero_expert_num: int = 0,
    copy_expert_num: int = 0,
    const_expert_num: int = 0,
    transport: str = "",
    exact_size: bool = False,
    handle: Optional[Tensor] = None,
) -> Tensor:
    _checked("dispatch_v2_backward", _dispatch_v2_backward_impl, dict(locals()), group_ep)
    args = _binding_args("dispatch_v2_backward", locals())
    args["handle"], args["handle_error"] = _handle_of("dispatch_v2_backward", handle)
    return tt(_C.dispatch_v2_backward(**args))


_dispatch_v2_backward_op = torch.library.custom_op(
    "moe_ep::dispatch_v2_backward", _dispatch_v2_backward_impl, mutates_args=()
)


@_dispatch_v2_backward_op.register_fake
def _(grad_expand_x, expert_ids, *args, **kwargs):
    _ndim("dispatch_v2_backward", "grad_expand_x", grad_expand_x, 2)
    _ndim("dispatch_v2_backward", "expert_ids", expert_ids, 2)
    return grad_expand_x.new_empty((expert_ids.shape[0], grad_expand_x.shape[1]))


def _combine_v2_backward_impl(
    grad_out: Tensor,
    expand_x: Tensor,
    expert_ids: Tensor,
    expert_scales: Tensor,
    group_ep: int,
    ep_world_size: int,
    ep_rank_id: int,
    moe_expert_num: int,
    x_active_mask: Optional[Tensor] = None,
    shared_expert_x: bool = False,
    ori_x: Optional[Tensor] = None,
    const_expert_alpha_1: Optional[Tensor] = None,
    const_expert_alpha_2: Optional[Tensor] = None,
    const_expert_v: Optional[Tensor] = None,
    group_tp: int = 0,
    tp_world_size: int = 0,
    tp_rank_id: int = 0,
    expert_shard_type: int = 0,
    shared_expert_num: int = 1,
    shared_expert_rank_num: int = 0,
    global_bs: int = 0,
    comm_alg: str = "",
    zero_expert_num: int = 0,
    copy_expert_num: int = 0,
    const_expert_num: int = 0,
    transport: str = "",
    exact_size: bool = False,
    handle: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    _checked("combine_v2_backward", _combine_v2_backward_impl, dict(locals()), group_ep)
    args = _binding_args("combine_v2_backward", locals())
    args["handle"], args["handle_error"] = _handle_of("combine_v2_backward", handle)
    outs = _C.combine_v2_backward(**args)
    # A custom op returns tensors only, none aliasing another: an absent gradient is an empty one.
    return tuple(grad_out.new_empty((0,)) if o is None else tt(o) for o in outs)


_combine_v2_backward_op = torch.library.custom_op(
    "moe_ep::combine_v2_backward", _combine_v2_backward_impl, mutates_args=()
)


@_combine_v2_backward_op.register_fake
def _(grad_out, expand_x, expert_ids, expert_scales, *args, **kwargs):
    bound = inspect.signature(_combine_v2_backward_impl).bind(
        grad_out, expand_x, expert_ids, expert_scales, *args, **kwargs
    )
    bound.apply_defaults()
    a = bound.arguments
    bs, h = expert_ids.shape[0], expand_x.shape[1]
    q = a["const_expert_num"]
    none = lambda: grad_out.new_empty((0,))  # noqa: E731
    rows = lambda n: grad_out.new_empty((n, h))  # noqa: E731
    return (
        expand_x.new_empty(expand_x.shape),
        grad_out.new_empty((bs, expert_ids.shape[1]), dtype=torch.float32),
        rows(bs) if a["shared_expert_x"] else none(),
        rows(bs) if a["copy_expert_num"] > 0 or q > 0 else none(),
        *(rows(q) if q > 0 else none() for _ in range(3)),
    )


def _bound(impl, inputs) -> Dict[str, object]:
    bound = inspect.signature(impl).bind(*inputs)
    bound.apply_defaults()
    return dict(bound.arguments)


def _dispatch_setup(ctx, inputs, output) -> None:
    a = _bound(_dispatch_v2_impl, inputs)
    ctx.ep = {k: a[k] for k in ("group_ep", "ep_world_size", "ep_rank_id", "moe_expert_num",
                                *_EP_ARGS)}
    ctx.quant_mode = a["quant_mode"]
    ctx.rows = (output[0].shape, output[0].dtype)
    ctx.save_for_backward(a["expert_ids"], a["x_active_mask"], output[7])
    ctx.mark_non_differentiable(*output[1:])


def _dispatch_backward(ctx, grad_expand_x, *_):
    if ctx.quant_mode == 2:
        raise UnsupportedError(
            "dispatch_v2: no gradient with quant_mode = 2 (SPEC §6: int8 rows have no gradient)"
        )
    expert_ids, mask, handle = ctx.saved_tensors
    if grad_expand_x is None:  # the rows fed nothing that needs a gradient: still collective
        grad_expand_x = torch.zeros(ctx.rows[0], dtype=ctx.rows[1])
    grad_x = torch.ops.moe_ep.dispatch_v2_backward(
        grad_expand_x.contiguous(), expert_ids, x_active_mask=mask, handle=handle, **ctx.ep
    )
    return (grad_x,) + (None,) * (len(inspect.signature(_dispatch_v2_impl).parameters) - 1)


_COMBINE_GRADS = ("expand_x", "expert_scales", "shared_expert_x", "ori_x",
                  "const_expert_alpha_1", "const_expert_alpha_2", "const_expert_v")


def _combine_setup(ctx, inputs, output) -> None:
    a = _bound(_combine_v2_impl, inputs)
    ctx.ep = {k: a[k] for k in ("group_ep", "ep_world_size", "ep_rank_id", "moe_expert_num",
                                *_EP_ARGS)}
    ctx.comm_quant_mode = a["comm_quant_mode"]
    sx = a["shared_expert_x"]
    ctx.shared_shape = None if sx is None else sx.shape
    ctx.names = list(a)
    ctx.save_for_backward(
        a["expand_x"], a["expert_ids"], a["expert_scales"], a["x_active_mask"], a["ori_x"],
        a["const_expert_alpha_1"], a["const_expert_alpha_2"], a["const_expert_v"], a["handle"],
    )


def _combine_backward(ctx, grad_out):
    if ctx.comm_quant_mode == 2:
        raise UnsupportedError(
            "combine_v2: no gradient with comm_quant_mode = 2 "
            "(SPEC §6: int8 rows have no gradient)"
        )
    expand_x, ids, scales, mask, ori_x, a1, a2, v, handle = ctx.saved_tensors
    if handle is None:
        raise InvalidArgumentError(
            "combine_v2: its backward needs handle= (the .handle of the dispatch_v2 these rows "
            "came from): SPEC §6's backward moves rows along the forward's layout"
        )
    outs = torch.ops.moe_ep.combine_v2_backward(
        grad_out.contiguous(), expand_x, ids, scales, x_active_mask=mask,
        shared_expert_x=ctx.shared_shape is not None, ori_x=ori_x, const_expert_alpha_1=a1,
        const_expert_alpha_2=a2, const_expert_v=v, handle=handle, **ctx.ep,
    )
    grads = dict(zip(_COMBINE_GRADS, outs))
    if ctx.shared_shape is not None:
        grads["shared_expert_x"] = grads["shared_expert_x"].reshape(ctx.shared_shape)
    for name in _COMBINE_GRADS[2:]:
        if grads[name].numel() == 0 and grads[name].dim() == 1 and name != "shared_expert_x":
            grads[name] = None  # the forward had no such input
    if ctx.shared_shape is None:
        grads["shared_expert_x"] = None
    return tuple(grads.get(n) for n in ctx.names)


_dispatch_v2_functional.register_autograd(_dispatch_backward, setup_context=_dispatch_setup)
_combine_v2_functional.register_autograd(_combine_backward, setup_context=_combine_setup)


# ---------------------------------------------------------------------------------------------
# The Python face: mpi4py communicators instead of group ids.


class DispatchOutputs(NamedTuple):
    """dispatch_v2's outputs (SPEC §1.4); unpacks like the SPEC's 7-tuple. What dispatch_v2
    returns also has .handle (DispatchResult)."""

    # exact_size: valid rows instead of max(1,T)*A, 3 * valid entries of assist_info_for_combine
    expand_x: Tensor  # (max(1,T)*A, H): x's dtype, int8 with quant_mode 2
    dynamic_scales: Tensor  # (max(1,T)*A,) fp32 with quant_mode 2, else (0,)
    assist_info_for_combine: Tensor  # (max(BS*K, A*128),) int32: for combine_v2
    expert_token_nums: Tensor  # (L,) int64: rows per local expert (or running sum, type 0)
    ep_recv_counts: Tensor  # (W*L*max(1,T),) int32 inclusive running sum: combine's ep_send_counts
    tp_recv_counts: Tensor  # (max(1,T),) int32
    expand_scales: Tensor  # (max(1,T)*A,) fp32


class DispatchResult(DispatchOutputs):
    """DispatchOutputs with the handle of the call (SPEC §7) as .handle: a (1,) int64 tensor to
    pass as combine_v2(..., handle=d.handle) (then only the rows travel back) or as
    dispatch_v2(..., handle=d.handle) with the same routing (a cached dispatch). The plan lives as
    long as that tensor (pass it itself: a copy names no plan). Tuple operations (_replace,
    pickling, pytree flattening) keep the 7 outputs only."""

    handle: Tensor


def dispatch_v2(
    x: Tensor,
    expert_ids: Tensor,
    group_ep=None,
    ep_world_size: Optional[int] = None,
    ep_rank_id: Optional[int] = None,
    moe_expert_num: int = 0,
    *,
    group_tp=None,
    async_op: bool = False,
    out=None,
    **kwargs,
):
    """SPEC §1: moves each token to the ranks that host its experts.

    x (BS, H) bf16/fp16/fp32; expert_ids (BS, K) int32 (torch.topk's indices are int64: .int()).
    group_ep: an mpi4py communicator (None: MPI.COMM_WORLD) or a group id; ep_world_size /
    ep_rank_id default to its size and rank. When BS differs across ranks (a rank may have 0
    tokens), pass global_bs = ep_world_size * max BS (or a larger multiple of ep_world_size) on
    every rank, to combine_v2 as well (SPEC §1.3); with the default 0, InvalidArgumentError gives
    that value.
    group_tp: the TP pair's communicator when tp_world_size = 2. Keyword arguments as SPEC §1
    (scales, x_active_mask, expert_scales, elastic_info, performance_info (int64 (W,), added to
    in place), tp_world_size, tp_rank_id, expert_shard_type, shared_expert_num,
    shared_expert_rank_num, quant_mode, global_bs, expert_token_nums_type, comm_alg,
    zero_expert_num, copy_expert_num, const_expert_num), and transport: how ranks on one machine
    move rows, "shm" (MPI-3 shared-memory windows, one copy) or "mpi" (point-to-point; the same
    bits), "" (default): $MOE_EP_TRANSPORT, else "shm"; it must resolve to the same value on
    every rank (EpConfig::transport, include/moe_ep/dispatch.h).

    exact_size (default False; EpConfig::exact_size): True sizes the outputs that count rows to
    the rows this rank receives, valid = ep_recv_counts[-1], instead of SPEC §1.4's worst case A
    (which grows with the world size at a fixed BS), as DeepEP's normal mode does: expand_x
    (valid, H), dynamic_scales and expand_scales (valid,), assist_info_for_combine (3 * valid,);
    the shared-memory slot holds valid rows too. Every value is that of False. Pass the same to
    combine_v2, and the same on every rank (InvalidArgumentError on every rank otherwise).
    UnsupportedError with tp_world_size 2. Under torch.compile the row count is a data-dependent
    (unbacked) size.

    handle: the .handle of an earlier result with the same expert_ids and x_active_mask (a cached
    dispatch, SPEC §7: no counts round; the same outputs).

    async_op (default False): True starts the op on the communicator's worker thread and returns
    a DispatchWork at once (include/moe_ep/async.h): .wait() gives the DispatchResult below (the
    same bits; differentiable likewise), or raises the op's error; .is_completed(); and
    .wait_source(), each source rank's rows as they land (SourceRows), so experts can start on
    early rows. Keep the inputs unchanged until wait(). Needs mpi4py's default thread level
    (MPI_THREAD_MULTIPLE; UnsupportedError otherwise), tp_world_size 0 or 1, and no
    torch.compile (UnsupportedError).

    out: caller-allocated outputs (DispatchBuffers, include/moe_ep/dispatch.h), so that a serving
    loop allocates none per call: a DispatchResult, or a sequence of 7 tensors or None in its
    order (None: allocated as usual). Each must be contiguous, of the dtype and shape this call
    returns for it (dispatch_workspace gives the sizes; with exact_size, at least the rows
    written); the result then holds those tensors (with exact_size, views of their first rows).
    Keeping an earlier result as `out` (its expand_x a shared-memory slot still alive) lets the
    peers on this machine write into it in place. Eager and without autograd only: under
    torch.compile, with async_op=True, or with x requiring grad, UnsupportedError. A wrong shape,
    dtype or layout: InvalidArgumentError naming out.<name> (on every rank at once).

    Returns DispatchResult (expand_x, dynamic_scales ((0,) unless quant_mode 2),
    assist_info_for_combine, expert_token_nums, ep_recv_counts, tp_recv_counts, expand_scales;
    SPEC §1.4), which also carries .handle, the plan of this call (SPEC §7). Only the first
    ep_recv_counts[-1] rows of expand_x are valid (the rows after them are unspecified: left
    over from earlier calls; with exact_size there are none). Differentiable in x (SPEC §6;
    not with performance_info, which takes the op without autograd).
    Errors: moe_ep.InvalidArgumentError / UnsupportedError on this rank's bad arguments,
    RemoteError when another rank's were bad, TimeoutError past the deadline (docs/errors.md).
    """
    gid, size, rank = _resolve(group_ep, "dispatch_v2", "group_ep")
    _check_async_op("dispatch_v2", async_op, gid)
    ep_world_size = size if ep_world_size is None else ep_world_size
    ep_rank_id = rank if ep_rank_id is None else ep_rank_id
    tp = _front_checks("dispatch_v2", _dispatch_v2_impl, gid, group_tp, dict(
        x=x, expert_ids=expert_ids, ep_world_size=ep_world_size, ep_rank_id=ep_rank_id,
        moe_expert_num=moe_expert_num, **kwargs))
    if out is not None:
        return _dispatch_v2_into(out, async_op, dict(
            x=x, expert_ids=expert_ids, group_ep=gid, ep_world_size=ep_world_size,
            ep_rank_id=ep_rank_id, moe_expert_num=moe_expert_num, group_tp=tp, **kwargs))
    if async_op:
        from moe_ep.torch import _async

        return _async.start_dispatch(
            (x, expert_ids, gid, ep_world_size, ep_rank_id, moe_expert_num),
            dict(group_tp=tp, **kwargs))
    with_perf = kwargs.get("performance_info") is not None
    op = torch.ops.moe_ep.dispatch_v2 if with_perf else torch.ops.moe_ep._dispatch_v2_functional
    with _checked_by_front("dispatch_v2"):
        outs = op(
            x,
            expert_ids,
            gid,
            ep_world_size,
            ep_rank_id,
            moe_expert_num,
            group_tp=tp,
            **kwargs,
        )
    result = DispatchResult(*outs[:7])
    result.handle = outs[7]
    return result


def combine_v2(
    expand_x: Tensor,
    expert_ids: Tensor,
    assist_info_for_combine: Optional[Tensor],
    ep_send_counts: Optional[Tensor],
    expert_scales: Tensor,
    group_ep=None,
    ep_world_size: Optional[int] = None,
    ep_rank_id: Optional[int] = None,
    moe_expert_num: int = 0,
    *,
    group_tp=None,
    async_op: bool = False,
    out: Optional[Tensor] = None,
    **kwargs,
):
    """SPEC §2: brings the expert outputs back as the weighted sum of SPEC §2.3.

    expand_x: the expert outputs, row for row in dispatch_v2's layout; expert_ids,
    assist_info_for_combine, ep_send_counts (dispatch_v2's ep_recv_counts) and expert_scales
    (BS, K) fp32 as SPEC §2.1. group_ep / group_tp as dispatch_v2. Keyword arguments as SPEC §2
    (tp_send_counts, x_active_mask, expand_scales, shared_expert_x, elastic_info, ori_x,
    const_expert_alpha_1/2, const_expert_v, performance_info, tp_world_size, tp_rank_id,
    expert_shard_type, shared_expert_num, shared_expert_rank_num, global_bs, comm_quant_mode,
    comm_alg, zero/copy/const_expert_num), transport and exact_size (as dispatch_v2's: with
    exact_size True, assist_info_for_combine must hold at least 3 * the valid rows, else SPEC's
    max(BS*K, A*128) entries; expand_x at least the valid rows either way). handle: the .handle
    of the dispatch_v2 result these rows came from (SPEC §7): then only the rows travel (no layout
    round, no per-row checks; the same bits) and assist_info_for_combine / ep_send_counts are not
    read (they may be None). Returns x (BS, H) in expand_x's dtype. Differentiable (SPEC §6) in
    expand_x, expert_scales, shared_expert_x, ori_x and the const tables when handle is given
    (without performance_info); with comm_quant_mode 2 none is, and an input that requires grad
    (grad mode on) is an UnsupportedError here, at the forward. Without handle, both
    assist_info_for_combine and ep_send_counts are required.
    async_op (default False): True starts the op and returns a CombineWork at once, whose
    .wait() gives x (or raises the op's error), as dispatch_v2's async_op.
    out: the caller's contiguous (BS, H) tensor of expand_x's dtype, written and returned
    (CombineInputs::out); eager and without autograd only, as dispatch_v2's out.
    """
    gid, size, rank = _resolve(group_ep, "combine_v2", "group_ep")
    _check_async_op("combine_v2", async_op, gid)
    ep_world_size = size if ep_world_size is None else ep_world_size
    ep_rank_id = rank if ep_rank_id is None else ep_rank_id
    tp = _front_checks("combine_v2", _combine_v2_impl, gid, group_tp, dict(
        expand_x=expand_x, expert_ids=expert_ids, assist_info_for_combine=assist_info_for_combine,
        ep_send_counts=ep_send_counts, expert_scales=expert_scales, ep_world_size=ep_world_size,
        ep_rank_id=ep_rank_id, moe_expert_num=moe_expert_num, **kwargs))
    if out is not None:
        return _combine_v2_into(out, async_op, dict(
            expand_x=expand_x, expert_ids=expert_ids,
            assist_info_for_combine=assist_info_for_combine, ep_send_counts=ep_send_counts,
            expert_scales=expert_scales, group_ep=gid, ep_world_size=ep_world_size,
            ep_rank_id=ep_rank_id, moe_expert_num=moe_expert_num, group_tp=tp, **kwargs))
    if async_op:
        from moe_ep.torch import _async

        return _async.start_combine(
            (expand_x, expert_ids, assist_info_for_combine, ep_send_counts, expert_scales, gid,
             ep_world_size, ep_rank_id, moe_expert_num), dict(group_tp=tp, **kwargs))
    with_perf = kwargs.get("performance_info") is not None
    op = torch.ops.moe_ep.combine_v2 if with_perf else torch.ops.moe_ep._combine_v2_functional
    with _checked_by_front("combine_v2"):
        return op(
            expand_x,
            expert_ids,
            assist_info_for_combine,
            ep_send_counts,
            expert_scales,
            gid,
            ep_world_size,
            ep_rank_id,
            moe_expert_num,
            group_tp=tp,
            **kwargs,
        )


_DISPATCH_OUTPUTS = ("expand_x", "dynamic_scales", "assist_info_for_combine", "expert_token_nums",
                     "ep_recv_counts", "tp_recv_counts", "expand_scales")


def _out_error(op: str, out, async_op, values: Dict[str, object]) -> Optional[Error]:
    """What makes an out= call unsupported or malformed, or None."""
    if async_op:
        return UnsupportedError(f"{op}: out= with async_op=True is unsupported")
    if op == "dispatch_v2":
        if not isinstance(out, (tuple, list)) or len(out) != 7 or not all(
                t is None or isinstance(t, Tensor) for t in out):
            return InvalidArgumentError(
                f"dispatch_v2: out = {_args.show(out)} must be a DispatchResult or a sequence of "
                f"7 tensors or None ({', '.join(_DISPATCH_OUTPUTS)})")
    elif not isinstance(out, Tensor):
        return InvalidArgumentError(f"combine_v2: out = {_args.show(out)} must be a tensor")
    given = zip(_DISPATCH_OUTPUTS, out) if op == "dispatch_v2" else [("", out)]
    for name, t in given:
        if t is not None and t.requires_grad:
            return InvalidArgumentError(
                f"{op}: out{'.' + name if name else ''} requires grad; out= tensors are written "
                "in place (pass ones that do not)")
    if torch.is_grad_enabled():
        for name in _GRAD_INPUTS[op][1]:
            t = values.get(name)
            if isinstance(t, Tensor) and t.requires_grad:
                return UnsupportedError(
                    f"{op}: out= does not support autograd, and {name} requires grad (call it "
                    "under torch.no_grad(), or without out=)")
    return None


def _into(given: Optional[Tensor], made) -> Tensor:
    """The result for one output the caller gave: that tensor, or (exact_size) its first rows.
    Written outside the torch dispatcher, so its version counter is bumped here: autograd then
    refuses a backward through an earlier use of it, as after any in-place write."""
    torch.autograd.graph.increment_version(given)
    made = tt(made)
    if tuple(given.shape) == tuple(made.shape):
        return given
    return given[: made.shape[0]]


def _into_args(op: str, out, async_op, values: Dict[str, object]) -> Dict[str, object]:
    """The binding's arguments of an out= call (which bypasses the torch dispatcher), after its
    checks (raised through the collective)."""
    if torch.compiler.is_compiling():
        raise UnsupportedError(f"{op}: out= is unsupported under torch.compile")
    err = _out_error(op, out, async_op, values)
    if err is not None:
        _raise_in_collective(op, err, values["group_ep"], values["group_tp"],
                             values.get("tp_world_size"))
    handle = values.pop("handle", None)
    args = _binding_args(op, values)
    args["handle"], args["handle_error"] = _handle_of(op, handle)
    return args


def _dispatch_v2_into(out, async_op, values: Dict[str, object]) -> "DispatchResult":
    """dispatch_v2(..., out=...): the binding with DispatchBuffers."""
    args = _into_args("dispatch_v2", out, async_op, values)
    buffers = list(out)
    if values.get("quant_mode", 0) != 2 and buffers[1] is not None and buffers[1].numel() == 0:
        buffers[1] = None  # an earlier result's empty dynamic_scales: quant_mode 0 writes none
    made = _C.dispatch_v2(**args, out=buffers)  # written in place: the tensors themselves
    outs = [
        _into(given, m) if given is not None and m is not None
        else (torch.empty((0,), dtype=torch.float32) if m is None else tt(m))
        for given, m in zip(out, made[:7])
    ]
    result = DispatchResult(*outs)
    result.handle = _handle_tensor(made[7])
    return result


def _combine_v2_into(out, async_op, values: Dict[str, object]) -> Tensor:
    """combine_v2(..., out=...): the binding with CombineInputs::out."""
    return _into(out, _C.combine_v2(**_into_args("combine_v2", out, async_op, values), out=out))


def _check_async_op(op: str, async_op, gid: int) -> None:
    """async_op is a bool; else raised through op's collective (the peers, synchronous or not,
    raise RemoteError instead of waiting for this rank)."""
    try:
        _args.boolean(op, "async_op", async_op)
    except Error as err:
        _raise_in_collective(op, err, gid, 0, None)


def _front_checks(op: str, impl, gid: int, group_tp, values: Dict[str, object]) -> int:
    """The wrappers' checks, before the torch dispatcher (which raises its own RuntimeError for a
    list or a float and takes True as 1): a malformed argument, group_tp included, is raised
    through op's collective. Returns group_tp's id (0: none). Under torch.compile only the
    gradient check runs, raised on every rank alike (the fake implementations check the
    shapes)."""
    if torch.compiler.is_compiling():
        # Every rank traces the same check (the modes agree across ranks), so it raises alone.
        err = _no_gradient_error(op, values)
        if err is not None:
            raise err
        return _resolve(group_tp, op, "group_tp")[0] if group_tp is not None else 0
    tp, err = 0, None
    if group_tp is not None:
        try:
            tp = _resolve(group_tp, op, "group_tp")[0]
        except Error as e:  # torch_npu's names carry their own message (front_error)
            err = e if (getattr(group_tp, "front_error", None) is e
                        or str(e).startswith(f"{op}: group_tp")) else type(e)(
                f"{op}: group_tp = {_args.show(group_tp)}: {e}")
    values["group_tp"] = tp
    if err is None:
        err = _arg_error(op, impl, values)
    if err is None:
        err = _no_gradient_error(op, values)
    if err is not None:
        _raise_in_collective(op, err, gid, tp, values.get("tp_world_size"))
    return tp


# The inputs autograd differentiates (SPEC §6), per op; with quant_mode 2 (dispatch_v2) or
# comm_quant_mode 2 (combine_v2) the rows travel as int8, which has no gradient.
_GRAD_INPUTS = {
    "dispatch_v2": ("quant_mode", ("x",)),
    "combine_v2": ("comm_quant_mode", ("expand_x", "expert_scales", "shared_expert_x", "ori_x",
                                       "const_expert_alpha_1", "const_expert_alpha_2",
                                       "const_expert_v")),
}


def _no_gradient_error(op: str, values: Dict[str, object]) -> Optional[Error]:
    """UnsupportedError when autograd would need a gradient the op cannot give: an int8 mode
    (quant_mode / comm_quant_mode 2) while grad mode is on and an input autograd differentiates
    requires grad. Raised at the forward (through the collective, like an argument error) rather
    than as a missing gradient (dispatch_v2: its int8 expand_x has none) or at backward()
    (combine_v2). Not with performance_info (that op has no autograd)."""
    mode_name, inputs = _GRAD_INPUTS.get(op, ("", ()))
    if values.get(mode_name) != 2 or values.get("performance_info") is not None:
        return None
    if not torch.is_grad_enabled():
        return None
    needs = [n for n in inputs if isinstance(values.get(n), Tensor) and values[n].requires_grad]
    if not needs:
        return None
    return UnsupportedError(
        f"{op}: {mode_name} = 2 has no gradient (SPEC §6: int8 rows have none), but "
        f"{', '.join(needs)} require{'s' if len(needs) == 1 else ''} grad with grad mode on: "
        f"use {mode_name} = 0 for training, or run the op under torch.no_grad() (or on "
        f"{'.detach()' if len(needs) == 1 else 'detached tensors'})"
    )


# ---------------------------------------------------------------------------------------------
# The size query


class DispatchWorkspace(NamedTuple):
    """The memory one dispatch_v2 call and the combine_v2 that follows it take on this rank
    (moe_ep::DispatchWorkspace, include/moe_ep/dispatch.h). Ints; all but recv_rows in bytes."""

    recv_rows: int  # A (SPEC §1.4): expand_x has max(1,T)*A rows
    expand_x_bytes: int  # max(1,T)*A * H * (1 with quant_mode 2, else x's element size)
    # the other dispatch_v2 outputs together: assist_info_for_combine (max(BS*K, A*128) * 4),
    # expand_scales and (quant_mode 2) dynamic_scales (max(1,T)*A * 4 each), ep_recv_counts,
    # tp_recv_counts and expert_token_nums
    other_outputs_bytes: int
    # shared-memory transport (0 when the calls use MPI only: transport "mpi", or "" with
    # $MOE_EP_TRANSPORT=mpi, or tp_world_size 2): the window part one dispatch_v2 output holds
    # while its expand_x lives (expand_x_bytes rounded up to 64, plus 16 bytes of metadata per
    # row of expand_x, all rounded up to 4 KiB), and what a combine_v2 stages when its expand_x
    # is not such a slot or comm_quant_mode is 2 (A rows, 1 byte per element with
    # comm_quant_mode 2, else x's element size; rounded up to 4 KiB)
    shm_slot_bytes: int
    shm_stage_bytes: int
    combine_output_bytes: int  # combine_v2's x: BS * H * x's element size


# dispatch_workspace's keyword arguments and their types.
_WORKSPACE_KWARGS = {
    **{k: "int" for k in ("tp_world_size", "tp_rank_id", "expert_shard_type", "shared_expert_num",
                          "shared_expert_rank_num", "quant_mode", "global_bs", "comm_quant_mode",
                          "zero_expert_num", "copy_expert_num", "const_expert_num")},
    "comm_alg": "str",
    "transport": "str",
    "exact_size": "bool",
}


def dispatch_workspace(
    bs: int,
    hidden: int,
    top_k: int,
    dtype: torch.dtype,
    group_ep=None,
    ep_world_size: Optional[int] = None,
    ep_rank_id: Optional[int] = None,
    moe_expert_num: int = 0,
    *,
    group_tp=None,
    **kwargs,
) -> DispatchWorkspace:
    """The bytes one dispatch_v2 and the combine_v2 that follows it take on this rank, before any
    call: plan memory, and size the shared-memory window up front (group_id(comm,
    shm_window_bytes=n * shm_slot_bytes + shm_stage_bytes) for n dispatch_v2 outputs alive at
    once, so that no call grows it). moe_ep::dispatch_workspace, include/moe_ep/dispatch.h;
    sizes of SPEC §1.4's outputs.

    Local: no communication, so the other ranks need not call it. But the first use of an mpi4py
    communicator registers it (group_id: MPI_Comm_dup, collective); pass a communicator already
    used (or registered with group_id) or its group id when only some ranks query. A
    communicator that only this query has registered can still be given its options:
    group_id(comm, shm_window_bytes=...) (on every rank, before any op on it) registers it again
    with them.

    bs: this rank's tokens (x.shape[0], >= 0). hidden: H (x.shape[1], >= 1). top_k: K
    (expert_ids.shape[1], in [1, moe_expert_num + zero/copy/const experts]). dtype: x's,
    torch.bfloat16, torch.float16 or torch.float32. group_ep: an mpi4py communicator (None:
    MPI.COMM_WORLD) or a group id; ep_world_size / ep_rank_id default to its size and rank.
    moe_expert_num: E. group_tp: the TP pair's communicator when tp_world_size = 2. Keyword
    arguments as dispatch_v2's (tp_world_size, tp_rank_id, expert_shard_type, shared_expert_num,
    shared_expert_rank_num, global_bs, comm_alg, zero_expert_num, copy_expert_num,
    const_expert_num, quant_mode: 0 or 2), and combine_v2's comm_quant_mode (0 or 2); no
    elastic_info (a scale-in changes W and A: query with the new world's arguments), and
    transport and exact_size as the ops' ("" (default): $MOE_EP_TRANSPORT, else "shm"; with
    exact_size True the sizes are the most a call takes, each call taking its valid rows).

    Returns DispatchWorkspace (recv_rows, expand_x_bytes, other_outputs_bytes, shm_slot_bytes,
    shm_stage_bytes, combine_output_bytes): ints, all but recv_rows in bytes.
    Errors: moe_ep.InvalidArgumentError / UnsupportedError for the EP arguments (dispatch_v2's
    checks, e.g. ep_rank_id not group_ep's rank) and for bs, hidden, top_k, dtype (int8, int32,
    int64, bool), quant_mode, comm_quant_mode out of range, with the C++ message
    ("dispatch_workspace: hidden = 0 must be in [1, 2147483647] (x.shape[1])", docs/errors.md);
    UnsupportedError for a dtype moe_ep cannot represent (torch.float64, ...);
    InvalidArgumentError for an unknown keyword argument or an argument of the wrong type (a bool
    or a float for an int, ...).
    """
    op = "dispatch_workspace"
    for pname, value in dict(bs=bs, hidden=hidden, top_k=top_k, ep_world_size=ep_world_size,
                             ep_rank_id=ep_rank_id, moe_expert_num=moe_expert_num,
                             **kwargs).items():
        kind = _WORKSPACE_KWARGS.get(pname, "int")
        if pname in ("ep_world_size", "ep_rank_id"):
            _args.integer(op, pname, value, optional=True)
        elif pname not in _WORKSPACE_KWARGS and pname not in ("bs", "hidden", "top_k",
                                                               "moe_expert_num"):
            raise InvalidArgumentError(
                f"{op}: {pname} is not a keyword argument of {op} (its keywords: "
                f"{', '.join(_WORKSPACE_KWARGS)})")
        else:
            _KINDS[kind](op, pname, value)
    _args.dtype(op, "dtype", dtype)
    name = dtype_name(op, "dtype", dtype, any_dtype=True)
    known = set(_groups)
    gid, size, rank = _resolve(group_ep, op, "group_ep")
    if gid not in known:  # registered by this call: group_id may still set its options
        _query_only.add(gid)
    tp = (_group(op, "group_tp", _resolve(group_tp, op, "group_tp")[0])
          if group_tp is not None else None)
    sizes = _C.dispatch_workspace(
        bs,
        hidden,
        top_k,
        name,
        _group(op, "group_ep", gid),
        size if ep_world_size is None else ep_world_size,
        rank if ep_rank_id is None else ep_rank_id,
        moe_expert_num,
        group_tp=tp,
        **kwargs,
    )
    return DispatchWorkspace(**sizes)


__all__: List[str] = [
    "DispatchOutputs",
    "DispatchWorkspace",
    "combine_v2",
    "dispatch_v2",
    "dispatch_workspace",
    "group_id",
    "release_group",
]
