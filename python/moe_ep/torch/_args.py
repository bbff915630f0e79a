"""Argument checks of the Python front: the type of every argument, before any op runs.

The torch dispatcher lets None through where a tensor is declared, takes True as the int 1 and
raises its own RuntimeError for a list or a float; the C++ binding would then fail with an
AttributeError or allocate an output of any size. These checks raise moe_ep.InvalidArgumentError
naming the op, the parameter, the value (with its type) and what was expected, and refuse output
sizes beyond out_bytes_bound() before anything is allocated. Each check returns None or raises.
"""

from __future__ import annotations

import functools
import numbers
import os
from typing import Dict, Optional, Sequence

import torch

from moe_ep import InvalidArgumentError

# No output, however much memory the machine has, may exceed this: products of sizes past it are
# certainly a mistake, and the C++ checks (2^63 bytes) are never reached with an overflowed one.
MAX_OUT_BYTES = 1 << 62


def show(v: object) -> str:
    """A value as messages show it: its repr (cut at 60 characters) and its type."""
    r = repr(v)
    if len(r) > 60:
        r = r[:57] + "..."
    return f"{r} ({type(v).__name__})"


@functools.lru_cache(maxsize=None)
def out_bytes_bound() -> int:
    """The most bytes one output may take: this machine's physical memory (an output larger than
    that cannot be allocated, or only to be swapped to death), at most 2^62."""
    try:
        phys = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        phys = MAX_OUT_BYTES
    return min(MAX_OUT_BYTES, phys) if phys > 0 else MAX_OUT_BYTES


def bound_text(bound: int) -> str:
    if bound == MAX_OUT_BYTES:
        return "2^62 bytes"
    return f"{bound} bytes (this machine's physical memory, {bound / 2**30:.1f} GiB)"


def tensor(op: str, name: str, v: object, optional: bool = False) -> None:
    """v is a torch.Tensor (or None when optional)."""
    if v is None and optional:
        return
    if not isinstance(v, torch.Tensor):
        want = "a torch.Tensor or None" if optional else "a torch.Tensor"
        raise InvalidArgumentError(f"{op}: {name} = {show(v)} must be {want}")


def integer(op: str, name: str, v: object, optional: bool = False) -> None:
    """v is an int (numpy integers too), not a bool (True is not the count 1), or None when
    optional."""
    if v is None and optional:
        return
    if isinstance(v, (bool, torch.SymBool)) or type(v).__name__ == "bool_":
        raise InvalidArgumentError(
            f"{op}: {name} = {show(v)} must be an int{' or None' if optional else ''}, not a bool"
        )
    if not isinstance(v, (numbers.Integral, torch.SymInt)):
        raise InvalidArgumentError(
            f"{op}: {name} = {show(v)} must be an int{' or None' if optional else ''}"
        )


def boolean(op: str, name: str, v: object) -> None:
    """v is a bool (numpy's too): an int is not taken as a flag."""
    if not isinstance(v, (bool, torch.SymBool)) and type(v).__name__ != "bool_":
        raise InvalidArgumentError(f"{op}: {name} = {show(v)} must be a bool")


def string(op: str, name: str, v: object) -> None:
    if not isinstance(v, str):
        raise InvalidArgumentError(f"{op}: {name} = {show(v)} must be a str")


def dtype(op: str, name: str, v: object) -> None:
    if not isinstance(v, torch.dtype):
        raise InvalidArgumentError(f"{op}: {name} = {show(v)} must be a torch.dtype")


def int_list(op: str, name: str, v: object, optional: bool = False) -> None:
    """v is a list, tuple or torch.Size of ints (not bools), or None when optional."""
    if v is None and optional:
        return
    want = "a list of ints" + (" or None" if optional else "")
    if not isinstance(v, (list, tuple)):
        raise InvalidArgumentError(f"{op}: {name} = {show(v)} must be {want}")
    for i, e in enumerate(v):
        if isinstance(e, bool) or not isinstance(e, (numbers.Integral, torch.SymInt)):
            raise InvalidArgumentError(
                f"{op}: {name}[{i}] = {show(e)} must be an int ({name} must be {want})"
            )


def out_bytes(op: str, what: str, dims: Sequence[int], dt: torch.dtype) -> int:
    """Refuses an output of shape dims and dtype dt larger than out_bytes_bound(), before it is
    allocated; returns its bytes. Python ints: no overflow, however large the dims."""
    n = 1
    for d in dims:
        n *= max(int(d), 0)
    size = n * torch.empty((), dtype=dt).element_size()
    bound = out_bytes_bound()
    if size > bound:
        shape = ", ".join(str(int(d)) for d in dims)
        raise InvalidArgumentError(
            f"{op}: {what} = [{shape}] {str(dt).replace('torch.', '')} needs {size} bytes, "
            f"more than {bound_text(bound)}"
        )
    return size


def in_bytes(op: str, name: str, t: object) -> None:
    """An input tensor describes at most out_bytes_bound() bytes. An expanded tensor (stride 0)
    can describe far more elements than its memory holds; the op reads each of them (and copies
    it when its rows are not contiguous, _convert.dl), so one beyond memory is refused before
    anything is read or allocated."""
    if not isinstance(t, torch.Tensor):
        return
    size = t.numel() * t.element_size()
    bound = out_bytes_bound()
    if size > bound:
        shape = ", ".join(str(int(d)) for d in t.shape)
        raise InvalidArgumentError(
            f"{op}: {name}.shape = [{shape}] {str(t.dtype).replace('torch.', '')} describes "
            f"{size} bytes, more than {bound_text(bound)}; an expanded tensor? the op reads every "
            "element"
        )


def working_set(op: str, inputs: Dict[str, object], made: int) -> None:
    """The bytes the inputs describe plus those the op makes (outputs and scratch, `made`, and the
    copies of inputs whose rows are strided) within
    out_bytes_bound(): real inputs are in memory already and the outputs must fit beside them, so
    a call that needs more cannot run (it would be killed, or swap for minutes); an expanded input
    counts every element it describes, each of which the op reads."""
    parts = [(n, t.numel() * t.element_size()) for n, t in inputs.items()
             if isinstance(t, torch.Tensor)]
    # a tensor whose rows are strided is copied to contiguous rows first (_convert.dl)
    made += sum(t.numel() * t.element_size() for t in inputs.values()
                if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] > 1
                and t.stride(-1) != 1)
    total = sum(b for _, b in parts) + made
    bound = out_bytes_bound()
    if total > bound:
        each = ", ".join(f"{n} {b}" for n, b in parts)
        raise InvalidArgumentError(
            f"{op}: the inputs ({each} bytes) and what the op makes ({made} bytes: outputs, "
            f"scratch and copies) need {total} bytes together, more than {bound_text(bound)}"
        )
