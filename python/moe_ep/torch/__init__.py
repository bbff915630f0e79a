"""moe-ep's PyTorch front.

Importing this module registers the custom ops ``torch.ops.moe_ep.*`` (SPEC §4: token_permute,
token_permute_grad, token_permute_grad_v2, token_unpermute, _token_unpermute,
token_unpermute_grad, token_unpermute_grad_v2; SPEC §1-2: dispatch_v2, combine_v2; SPEC §6:
dispatch_v2_backward, combine_v2_backward), their fake implementations for torch.compile,
autograd for permute, unpermute, dispatch_v2 and combine_v2, and the DTensor sharding
rules of SPEC §5 (generated from the C++ strategy table). dispatch_workspace is dispatch_v2's size
query (local, a plain function).

dispatch_v2 / combine_v2 take mpi4py communicators (default: MPI.COMM_WORLD); start the processes
with mpirun; async_op=True starts them and returns a work object (DispatchWork, CombineWork) to
wait() on while the caller computes. moe_ep.torch.nn has them as a module: ExpertParallel (a MoE layer's experts over the
ranks, each holding its own), Lockstep and average_gradients.
"""

from moe_ep.torch.distributed import (
    DispatchOutputs,
    DispatchResult,
    DispatchWorkspace,
    combine_v2,
    dispatch_v2,
    dispatch_workspace,
    group_id,
    release_group,
)
from moe_ep.torch._async import CombineWork, DispatchWork, SourceRows
from moe_ep.torch.ops import (
    _token_unpermute,
    token_permute,
    token_permute_grad,
    token_permute_grad_v2,
    token_unpermute,
    token_unpermute_grad,
    token_unpermute_grad_v2,
)

import torch.distributed as _dist

if _dist.is_available():  # DTensor needs torch.distributed (the CPU wheels have it)
    from moe_ep.torch.sharding import register_rules as _register_rules

    _register_rules()

__all__ = [
    "CombineWork",
    "DispatchOutputs",
    "DispatchResult",
    "DispatchWork",
    "DispatchWorkspace",
    "SourceRows",
    "_token_unpermute",
    "combine_v2",
    "dispatch_v2",
    "dispatch_workspace",
    "group_id",
    "release_group",
    "token_permute",
    "token_permute_grad",
    "token_permute_grad_v2",
    "token_unpermute",
    "token_unpermute_grad",
    "token_unpermute_grad_v2",
]
