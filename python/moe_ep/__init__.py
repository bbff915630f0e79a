"""moe-ep: mixture-of-experts expert parallelism.

``moe_ep._C`` is the framework-agnostic DLPack binding of the C++ library; ``moe_ep.torch``
registers the PyTorch custom ops (``torch.ops.moe_ep.*``) with autograd, fake implementations
for torch.compile and DTensor sharding rules.
"""

from moe_ep._C import (
    Error,
    InternalError,
    InvalidArgumentError,
    RemoteError,
    SystemError,
    TimeoutError,
    UnsupportedError,
    check_environment,
    num_threads,
    set_num_threads,
)

__version__ = "0.1.0"

# moe_ep.TimeoutError and moe_ep.SystemError are left out of __all__: a star import would shadow
# the builtins of the same name.
__all__ = [
    "Error",
    "InternalError",
    "InvalidArgumentError",
    "RemoteError",
    "UnsupportedError",
    "__version__",
    "check_environment",
    "num_threads",
    "set_num_threads",
]
