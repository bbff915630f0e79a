"""dispatch_v2 / combine_v2 with async_op=True: the op is started on the communicator's worker
thread (include/moe_ep/async.h) and a work object is returned at once; its wait() gives what the
synchronous call returns, bit for bit, and raises what it raises. The caller computes meanwhile,
e.g. the experts of another micro-batch.

Autograd: when grad mode is on at the start and an input the op differentiates requires grad,
wait() attaches the op to the graph as the synchronous call would (the same backward ops, which
run synchronously). The op reads its inputs while it runs: do not change them in place before
wait(). The module keeps them (and the copies the binding was given, e.g. of a tensor whose rows
are strided) alive until the op has ended, also for a work object dropped before wait() (its op
still runs to its end: every rank runs it), and waits for every started op at interpreter exit,
before mpi4py finalises MPI under the worker.
"""

from __future__ import annotations

import inspect
from typing import Dict, List, NamedTuple, Optional

import torch
from torch import Tensor

from moe_ep import UnsupportedError, _C
from moe_ep.torch import distributed as _d
from moe_ep.torch._convert import tt


class SourceRows(NamedTuple):
    """The rows one source rank sent this rank, landed (DispatchWork.wait_source): for local
    expert l, rows offsets[l] : offsets[l] + rows[l] of expand_x (SPEC §1.4's order), with their
    expand_scales, assist_info_for_combine entries (and dynamic_scales with quant_mode 2). expand_x is the tensor wait() returns
    (the same memory), valid for these rows and those of the sources returned before."""

    source: int
    offsets: List[int]
    rows: List[int]
    expand_x: Tensor
    dynamic_scales: Optional[Tensor]
    expand_scales: Tensor
    assist_info_for_combine: Tensor


# Every op started and not yet seen ended and waited for: [pending op, what its worker may still
# read (None once it has ended), whether the caller waited for it].
_inflight: List[list] = []
_exit_hook = []


def _keep(pending, *buffers) -> list:
    for record in _inflight:
        if record[1] is not None and record[0].test():
            record[1] = None  # ended: the worker reads nothing more
    _inflight[:] = [r for r in _inflight if not (r[1] is None and r[2])]
    record = [pending, buffers, False]
    _inflight.append(record)
    if not _exit_hook:
        import atexit

        atexit.register(_wait_all)
        _exit_hook.append(True)
    return record


def _wait_all() -> None:
    """At exit (before MPI is finalised): waits for the ops nobody waited for. One that failed
    (a peer that never ran it: its deadline) is reported on stderr and ends the process with
    status 1, as the synchronous call's error would have."""
    failed = None
    for pending, _, waited in _inflight:
        if waited:
            continue
        try:
            pending.wait()
        except Exception as e:  # noqa: BLE001  (reported below)
            failed = failed or e
    _inflight.clear()
    if failed is not None:
        import os
        import sys

        print(f"moe_ep: an op started with async_op=True and never waited for failed: "
              f"{type(failed).__name__}: {failed}", file=sys.stderr, flush=True)
        os._exit(1)


def _impl_args(impl, values: Dict[str, object]) -> list:
    return [values[n] for n in inspect.signature(impl).parameters]


def _refuse_compile(op: str) -> None:
    if torch.compiler.is_compiling():
        raise UnsupportedError(
            f"{op}: async_op=True cannot be traced by torch.compile (the work object is a Python "
            "object, not a tensor): call it outside the compiled region, or use async_op=False"
        )


class _Box:
    """Carries the finished outputs into the autograd.Function (not a tensor: not an input)."""

    def __init__(self, outs):
        self.outs = outs


class _AsyncDispatch(torch.autograd.Function):
    """Attaches a finished asynchronous dispatch_v2 to the graph of x: the backward of the
    synchronous op (distributed._dispatch_backward)."""

    @staticmethod
    def forward(box, *inputs):
        return tuple(box.outs)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _d._dispatch_setup(ctx, inputs[1:], output)

    @staticmethod
    def backward(ctx, *grads):
        return (None,) + tuple(_d._dispatch_backward(ctx, *grads))


class _AsyncCombine(torch.autograd.Function):
    """The same for combine_v2 (distributed._combine_backward)."""

    @staticmethod
    def forward(box, *inputs):
        return box.outs

    @staticmethod
    def setup_context(ctx, inputs, output):
        _d._combine_setup(ctx, inputs[1:], output)

    @staticmethod
    def backward(ctx, grad_out):
        return (None,) + tuple(_d._combine_backward(ctx, grad_out))


def _needs_grad(values: Dict[str, object], names) -> bool:
    return torch.is_grad_enabled() and any(
        isinstance(values.get(n), Tensor) and values[n].requires_grad for n in names
    )


class DispatchWork:
    """A started dispatch_v2 (async_op=True). wait() returns its DispatchResult (or raises its
    error: the errors of the synchronous call); it may be called again and returns the same
    result. is_completed() never blocks. wait_source() hands out each source rank's rows as they
    land (SourceRows), None once every source was handed out."""

    def __init__(self, pending, values: Dict[str, object], record: list):
        self._pending = pending
        self._values = values  # the inputs, for autograd at wait()
        self._record = record
        self._grad = _needs_grad(values, ("x",)) and values["performance_info"] is None
        self._result = self._error = None

    def is_completed(self) -> bool:
        return self._result is not None or self._pending.test()

    def wait(self) -> "_d.DispatchResult":
        if self._result is None:
            self._result = _finish(self, self._outputs)
        return self._result

    def _outputs(self):
        expand_x, dynamic_scales, *rest, plan = self._pending.wait()
        dynamic_scales = (torch.empty((0,), dtype=torch.float32) if dynamic_scales is None
                          else tt(dynamic_scales))
        outs = (tt(expand_x), dynamic_scales, *(tt(r) for r in rest), _d._handle_tensor(plan))
        if self._grad:
            with torch.enable_grad():
                outs = _AsyncDispatch.apply(
                    _Box(outs), *_impl_args(_d._dispatch_v2_impl, self._values))
        result = _d.DispatchResult(*outs[:7])
        result.handle = outs[7]
        return result

    def wait_source(self) -> Optional[SourceRows]:
        got = self._pending.wait_source()
        if got is None:
            return None
        source, offsets, rows, expand_x, dynamic_scales, expand_scales, assist = got
        return SourceRows(source, list(offsets), list(rows), tt(expand_x),
                          None if dynamic_scales is None else tt(dynamic_scales),
                          tt(expand_scales), tt(assist))


class CombineWork:
    """A started combine_v2 (async_op=True). wait() returns x (BS, H), as the synchronous call;
    again on a second call. is_completed() never blocks."""

    def __init__(self, pending, values: Dict[str, object], record: list):
        self._pending = pending
        self._values = values
        self._record = record
        self._grad = (_needs_grad(values, _d._COMBINE_GRADS)
                      and values["performance_info"] is None)
        self._result = self._error = None

    def is_completed(self) -> bool:
        return self._result is not None or self._pending.test()

    def wait(self) -> Tensor:
        if self._result is None:
            self._result = _finish(self, self._outputs)
        return self._result

    def _outputs(self):
        out = tt(self._pending.wait())
        if self._grad:
            with torch.enable_grad():
                out = _AsyncCombine.apply(_Box(out), *_impl_args(_d._combine_v2_impl, self._values))
        return out


def _finish(work, outputs):
    """The first wait() of a work: its outputs, or its error, raised again by every later wait()."""
    if work._error is not None:
        raise work._error
    try:
        return outputs()
    except Exception as e:
        work._error = e
        raise
    finally:
        work._record[2] = True
        work._values = None


def _start(op: str, impl, positional, kwargs):
    _refuse_compile(op)
    bound = inspect.signature(impl).bind(*positional, **kwargs)
    bound.apply_defaults()
    values = dict(bound.arguments)
    args = _d._binding_args(op, values)
    args["handle"], args["handle_error"] = _d._handle_of(op, values["handle"])
    args["async_op"] = True
    pending = getattr(_C, op)(**args)
    return pending, values, _keep(pending, values, args)


def start_dispatch(positional, kwargs) -> DispatchWork:
    return DispatchWork(*_start("dispatch_v2", _d._dispatch_v2_impl, positional, kwargs))


def start_combine(positional, kwargs) -> CombineWork:
    return CombineWork(*_start("combine_v2", _d._combine_v2_impl, positional, kwargs))
