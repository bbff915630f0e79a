"""Tensor hand-over between torch and moe_ep._C: DLPack both ways, no copies."""

from __future__ import annotations

from typing import Optional

import torch

_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def dl(t: Optional[torch.Tensor]):
    """A torch tensor as an input of moe_ep._C (None stays None), sharing its data. detach():
    DLPack refuses tensors that require grad. The kernels take strided rows but need each row
    contiguous; a tensor whose last dimension is strided (an expanded gradient, a transpose) is
    copied to a contiguous one first: the only copy this front makes."""
    if t is None:
        return None
    t = t.detach()
    if t.dim() >= 1 and t.shape[-1] > 1 and t.stride(-1) != 1:
        t = t.contiguous()
    return t


def tt(a) -> torch.Tensor:
    """A moe_ep._C output as a torch tensor sharing its storage."""
    return torch.from_dlpack(a)


def dtype_name(op: str, param: str, dtype: torch.dtype) -> str:
    """The binding's name of a float dtype, or moe_ep.UnsupportedError naming op and param."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        from moe_ep import UnsupportedError

        raise UnsupportedError(
            f"{op}: {param} = {dtype} is not one of torch.bfloat16, torch.float16, "
            "torch.float32"
        ) from None
