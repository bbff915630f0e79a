"""Tensor hand-over between torch and moe_ep._C: DLPack both ways, no copies."""

from __future__ import annotations

from typing import Optional

import torch

_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
# Every dtype moe_ep._C can represent, by its C++ name (moe_ep::dtype_name).
_ALL_DTYPE_NAMES = {
    **_DTYPE_NAMES,
    torch.int8: "int8",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.bool: "bool",
}


# The dtypes moe_ep._C can represent. Others (fp64, int16, ...) would be refused by the binding
# with a message naming neither the op nor the torch dtype, so dl() refuses them first when told
# the op and parameter. Representable but wrong dtypes are left to the C++ checks.
_BINDING_DTYPES = tuple(_ALL_DTYPE_NAMES)


def dl(t: Optional[torch.Tensor], op: Optional[str] = None, param: Optional[str] = None):
    """A torch tensor as an input of moe_ep._C (None stays None), sharing its data. detach():
    DLPack refuses tensors that require grad. The kernels take strided rows (and strided 1-D
    tensors) but need each row contiguous; a 2-D or larger tensor whose last dimension is strided (an expanded gradient, a transpose) is
    copied to a contiguous one first: the only copy this front makes. With op and param, a dtype
    the binding cannot take raises moe_ep.UnsupportedError naming them."""
    if t is None:
        return None
    if op is not None and t.dtype not in _BINDING_DTYPES:
        from moe_ep import UnsupportedError

        raise UnsupportedError(
            f"{op}: {param} dtype {t.dtype} is not supported (moe_ep takes torch.bfloat16, "
            "torch.float16, torch.float32 values and torch.int32, torch.int64 indices)"
        )
    t = t.detach()
    if t.dim() >= 2 and t.shape[-1] > 1 and t.stride(-1) != 1:
        t = t.contiguous()
    return t


def tt(a) -> torch.Tensor:
    """A moe_ep._C output as a torch tensor sharing its storage."""
    return torch.from_dlpack(a)


def dtype_name(op: str, param: str, dtype: torch.dtype, any_dtype: bool = False) -> str:
    """The binding's name of a float dtype, or moe_ep.UnsupportedError naming op and param.
    any_dtype: also the other dtypes moe_ep._C can represent (int8, int32, int64, bool), for an
    op that checks the dtype itself (InvalidArgumentError with its own message); dtypes it
    cannot represent (fp64, ...) still raise UnsupportedError here, as dl() does for tensors."""
    try:
        return (_ALL_DTYPE_NAMES if any_dtype else _DTYPE_NAMES)[dtype]
    except KeyError:
        from moe_ep import UnsupportedError

        raise UnsupportedError(
            f"{op}: {param} = {dtype} is not one of torch.bfloat16, torch.float16, "
            "torch.float32"
        ) from None
