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
)
from moe_ep import _C

__version__ = "0.1.0"

# The C++ bound: kMaxThreads (include/moe_ep/threads.h); n beyond int64 is refused here with the
# C++ message, which the binding could not take.
_INT64 = (-(2**63), 2**63 - 1)


def set_num_threads(n: int) -> None:
    """1 <= n <= 1024: moe-ep's parallel loops use n threads from now on (process-wide); 0: back
    to the automatic rule (num_threads). Raises InvalidArgumentError for n < 0, n > 1024, or an n
    that is not an int (a bool, a float, a string: the message names n, its value and its type;
    numpy integers are ints) (threads.h, kMaxThreads)."""
    if isinstance(n, bool) or type(n).__name__ == "bool_" or not hasattr(n, "__index__"):
        r = repr(n)
        r = r if len(r) <= 60 else r[:57] + "..."
        raise InvalidArgumentError(
            f"set_num_threads: n = {r} ({type(n).__name__}) must be an int (0: the automatic "
            "rule, 1 to 1024: that many threads)")
    v = n.__index__()
    if v < _INT64[0]:
        raise InvalidArgumentError(
            f"set_num_threads: n = {v} must be >= 0 (0: the automatic rule)")
    if v > _INT64[1]:
        raise InvalidArgumentError(
            f"set_num_threads: n = {v} exceeds 1024 (kMaxThreads, the most threads moe-ep runs "
            "a loop on)")
    _C.set_num_threads(v)



# ---------------------------------------------------------------------------------------------
# An uncaught exception on one rank ends the job (as `python -m mpi4py` does). Without this, the
# failed rank's interpreter waits at exit in MPI_Finalize for the other ranks, which wait for it in
# their next collective (its first op: the communicator's creation) until their deadline
# ($MOE_EP_TIMEOUT_S, default 300 s). moe_ep's hook prints the traceback through the hook that was
# installed before it (chained), then, when MPI is initialised and MPI_COMM_WORLD has more than
# one process, names the rank on stderr and calls MPI_Abort, which ends every process of the job
# (mpirun exits with status 1). MOE_EP_ABORT_ON_EXCEPTION=0 turns it off (1 or unset: on); an
# interactive session (python -i) never aborts. A single process, or MPI not initialised (the
# process then simply exits with status 1, which mpirun notices): the traceback only.


def _abort_on_exception_enabled() -> bool:
    import os

    value = os.environ.get("MOE_EP_ABORT_ON_EXCEPTION", "")
    if value in ("", "1"):
        return True
    if value == "0":
        return False
    import sys

    print(f"moe_ep: MOE_EP_ABORT_ON_EXCEPTION = {value!r} is not 0 or 1; using 1 (abort the job "
          "on an uncaught exception)", file=sys.stderr)
    return True


def _install_excepthook() -> None:
    import sys

    previous = sys.excepthook

    def excepthook(exc_type, exc, tb):
        try:
            previous(exc_type, exc, tb)
        finally:
            if not (hasattr(sys, "ps1") or sys.flags.interactive) and _abort_on_exception_enabled():
                for stream in (sys.stdout, sys.stderr):
                    try:
                        stream.flush()
                    except Exception:  # a closed or broken stream must not stop the abort
                        pass
                from moe_ep import _C as C

                C._abort_job(f"{exc_type.__module__}.{exc_type.__qualname__}"
                             if exc_type.__module__ != "builtins" else exc_type.__qualname__)

    excepthook.moe_ep_previous = previous  # the chained hook (tests, and whoever unhooks it)
    sys.excepthook = excepthook


_install_excepthook()

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
