"""Run under mpirun -n 2 (test_pyargs.py launches it): rank 1 passes one malformed argument to
dispatch_v2 / combine_v2 per case, rank 0 a valid call. Rank 1 must raise the front's error
naming the parameter, rank 0 moe_ep.RemoteError naming rank 1 and the same cause, each within a
second (MOE_EP_TIMEOUT_S is 20: a rank left waiting shows as a slow TimeoutError). Each rank
reports "CASE <name> rank=<r> OK" or "FAIL: ..." through mpi_report.say. A round trip before the
cases (the communicator's set-up, not timed) and one after them (the communicator still works)
check combine(dispatch(x)) == x with weights 1/2.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Callable, Dict, Tuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import moe_ep  # noqa: E402
import moe_ep.torch as mt  # noqa: E402
import moe_ep.torch_npu as npu  # noqa: E402
from mpi_report import say  # noqa: E402

BS, H, K, E = 4, 8, 2, 4
LIMIT_S = 1.0


def _valid(rank: int):
    x = torch.arange(BS * H, dtype=torch.float32).reshape(BS, H) + 100 * rank
    ids = torch.tensor([[(t + j) % E for j in range(K)] for t in range(BS)], dtype=torch.int32)
    w = torch.full((BS, K), 0.5)
    return x, ids, w


# case -> (op, rank 1's changes: positional index or keyword -> bad value, words rank 1's message
# must hold). Every kind the issue names: None, a list for a tensor, a float or a bool for an int,
# an int for a flag, a string for an int, a wrong keyword, a tensor too large, a bad group_tp.
_BIG_X = "expanded"  # a (2^40, H) view of one row: beyond any machine's memory
CASES: Dict[str, Tuple[str, dict, str]] = {
    "dispatch_x_none": ("dispatch_v2", {"x": None}, "x = None (NoneType) must be a torch.Tensor"),
    "dispatch_x_list": ("dispatch_v2", {"x": [[1.0] * H]}, "x = [[1.0"),
    "dispatch_ids_none": ("dispatch_v2", {"expert_ids": None}, "expert_ids = None"),
    "dispatch_expert_num_float": ("dispatch_v2", {"moe_expert_num": float(E)},
                                  "moe_expert_num = 4.0 (float) must be an int"),
    "dispatch_expert_num_bool": ("dispatch_v2", {"moe_expert_num": True},
                                 "moe_expert_num = True (bool) must be an int, not a bool"),
    "dispatch_world_size_str": ("dispatch_v2", {"ep_world_size": "2"},
                                "ep_world_size = '2' (str) must be an int"),
    "dispatch_quant_mode_bool": ("dispatch_v2", {"quant_mode": False},
                                 "quant_mode = False (bool)"),
    "dispatch_exact_size_int": ("dispatch_v2", {"exact_size": 1},
                                "exact_size = 1 (int) must be a bool"),
    "dispatch_scales_list": ("dispatch_v2", {"expert_scales": [0.5, 0.5]},
                             "expert_scales = [0.5, 0.5] (list) must be a torch.Tensor or None"),
    "dispatch_transport_int": ("dispatch_v2", {"transport": 3},
                               "transport = 3 (int) must be a str"),
    "dispatch_unknown_keyword": ("dispatch_v2", {"expert_num": E},
                                 "expert_num is not a keyword argument of dispatch_v2"),
    "dispatch_x_too_large": ("dispatch_v2", {"x": _BIG_X}, "more than"),
    "dispatch_group_tp_not_a_comm": ("dispatch_v2", {"group_tp": "tp"},
                                     "is not an mpi4py communicator"),
    # A = global_bs * min(E / W, K) = 2^40 * 2 rows of H = 8 (SPEC §1.4)
    "dispatch_global_bs_too_large": (
        "dispatch_v2", {"global_bs": 2**40},
        "expand_x (max(1, tp_world_size) * A, H) = [2199023255552, 8]"),
    "npu_dispatch_expert_num_float": ("npu_moe_distribute_dispatch_v2",
                                      {"moe_expert_num": float(E)},
                                      "moe_expert_num = 4.0 (float) must be an int"),
    "npu_combine_tp_world_size_str": ("npu_moe_distribute_combine_v2", {"tp_world_size": "0"},
                                      "tp_world_size = '0' (str) must be an int"),
    "npu_dispatch_group_tp_unknown": ("npu_moe_distribute_dispatch_v2", {"group_tp": "nope"},
                                      "group_tp = 'nope' is not a registered group name"),
    "dispatch_backward_grad_none": ("dispatch_v2_backward", {"grad_expand_x": None},
                                    "grad_expand_x = None (NoneType) must be a torch.Tensor"),
    "combine_backward_scales_none": ("combine_v2_backward", {"expert_scales": None},
                                     "expert_scales = None (NoneType) must be a torch.Tensor"),
    "combine_expand_x_none": ("combine_v2", {"expand_x": None}, "expand_x = None"),
    "combine_scales_list": ("combine_v2", {"expert_scales": [[0.5, 0.5]] * BS},
                            "expert_scales = [[0.5, 0.5]"),
    "combine_expert_num_float": ("combine_v2", {"moe_expert_num": 4.5},
                                 "moe_expert_num = 4.5 (float) must be an int"),
    "combine_comm_quant_bool": ("combine_v2", {"comm_quant_mode": True},
                                "comm_quant_mode = True (bool)"),
}

_DISPATCH_POS = ["x", "expert_ids", "group_ep", "ep_world_size", "ep_rank_id", "moe_expert_num"]
# torch_npu's names report as the moe_ep.torch op they call.
_OP_NAME = {"npu_moe_distribute_dispatch_v2": "dispatch_v2",
            "npu_moe_distribute_combine_v2": "combine_v2"}
_BACKWARD_POS = ["grad_expand_x", "expert_ids", "group_ep", "ep_world_size", "ep_rank_id",
                 "moe_expert_num"]
_COMBINE_BACKWARD_POS = ["grad_out", "expand_x", "expert_ids", "expert_scales", "group_ep",
                         "ep_world_size", "ep_rank_id", "moe_expert_num"]
_COMBINE_POS = ["expand_x", "expert_ids", "assist_info_for_combine", "ep_send_counts",
                "expert_scales", "group_ep", "ep_world_size", "ep_rank_id", "moe_expert_num"]


def _call(comm, rank: int, op: str, changes: dict) -> Callable[[], object]:
    x, ids, w = _valid(rank)
    size = comm.Get_size()
    if op == "dispatch_v2":
        pos, fn = _DISPATCH_POS, mt.dispatch_v2
        args = [x, ids, comm, None, None, E]
        kwargs = {"expert_scales": w}
    elif op == "npu_moe_distribute_dispatch_v2":
        pos, fn = _DISPATCH_POS, npu.npu_moe_distribute_dispatch_v2
        args = [x, ids, npu.group_name(comm), size, rank, E]
        kwargs = {"expert_scales": w}
    elif op == "npu_moe_distribute_combine_v2":
        d = npu.npu_moe_distribute_dispatch_v2(x, ids, npu.group_name(comm), size, rank, E)
        pos, fn = _COMBINE_POS, npu.npu_moe_distribute_combine_v2
        args = [d[0], ids, d[2], d[4], w, npu.group_name(comm), size, rank, E]
        kwargs = {}
    elif op == "dispatch_v2_backward":
        # torch.ops.moe_ep.dispatch_v2_backward called directly: the dispatcher passes None on
        # to the implementation, which reports it through the collective.
        d = mt.dispatch_v2(x, ids, comm, moe_expert_num=E)
        pos, fn = _BACKWARD_POS, torch.ops.moe_ep.dispatch_v2_backward
        args = [torch.ones_like(d.expand_x), ids, mt.group_id(comm), size, rank, E]
        kwargs = {"handle": d.handle}
    elif op == "combine_v2_backward":
        d = mt.dispatch_v2(x, ids, comm, moe_expert_num=E)
        pos, fn = _COMBINE_BACKWARD_POS, torch.ops.moe_ep.combine_v2_backward
        args = [torch.ones_like(x), d.expand_x, ids, w, mt.group_id(comm), size, rank, E]
        kwargs = {"handle": d.handle}
    else:
        d = mt.dispatch_v2(x, ids, comm, moe_expert_num=E)  # a valid dispatch on both ranks
        pos, fn = _COMBINE_POS, mt.combine_v2
        args = [d.expand_x, ids, d.assist_info_for_combine, d.ep_recv_counts, w, comm, None,
                None, E]
        kwargs = {}
    if rank == 1:
        for name, value in changes.items():
            if value is _BIG_X:
                value = torch.zeros(1, H).expand(2**40, H)
                kwargs["expert_scales"] = None
                args[pos.index("expert_ids")] = torch.zeros(1, K, dtype=torch.int32).expand(
                    2**40, K)
            if name in pos:
                args[pos.index(name)] = value
            else:
                kwargs[name] = value
    return lambda: fn(*args, **kwargs)


def run_case(comm, name: str) -> str:
    rank = comm.Get_rank()
    op, changes, words = CASES[name]
    call = _call(comm, rank, op, changes)
    comm.Barrier()  # both ranks enter together: the time measured is the error's, not a skew
    start = time.monotonic()
    seen = None
    try:
        call()
    except moe_ep.Error as e:
        seen = e
    except Exception as e:  # noqa: BLE001  (a foreign exception is a failure of this case)
        return f"FAIL: {type(e).__name__}: {e}"
    took = time.monotonic() - start
    if seen is None:
        return "FAIL: no error"
    msg = str(seen)
    if rank == 1:
        if type(seen) is not moe_ep.InvalidArgumentError:
            return f"FAIL: raised {type(seen).__name__}: {msg}"
        if not msg.startswith((op + ": ", _OP_NAME.get(op, op) + ": ")) or words not in msg:
            return f"FAIL: message does not name the op and {words!r}: {msg}"
    else:
        if type(seen) is not moe_ep.RemoteError:
            return f"FAIL: raised {type(seen).__name__}, want RemoteError: {msg}"
        if f"{_OP_NAME.get(op, op)}: rank 1 failed" not in msg or words not in msg:
            return f"FAIL: RemoteError does not name rank 1 and {words!r}: {msg}"
    if took >= LIMIT_S:
        return f"FAIL: took {took:.2f} s (limit {LIMIT_S} s): {msg}"
    return "OK"


def round_trip(comm) -> str:
    rank = comm.Get_rank()
    x, ids, w = _valid(rank)
    d = mt.dispatch_v2(x, ids, comm, moe_expert_num=E)
    y = mt.combine_v2(d.expand_x, ids, d.assist_info_for_combine, d.ep_recv_counts, w, comm,
                      moe_expert_num=E)
    # identity experts, weights 1/2 + 1/2: every token comes back as itself, bitwise
    return "OK" if torch.equal(y, x) else f"FAIL: round trip differs by {(y - x).abs().max()}"


def main() -> int:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    if comm.Get_size() != 2:
        say(f"CASE setup rank={rank} FAIL: needs 2 ranks, got {comm.Get_size()}")
        return 1
    mt.group_id(comm)
    # A valid round trip first: the first call on a communicator sets up its windows (seconds on
    # a loaded machine), which is not what the cases time.
    verdict = round_trip(comm)
    say(f"CASE round_trip_before_errors rank={rank} {verdict}")
    failed = verdict != "OK"
    for name in CASES:
        verdict = run_case(comm, name)
        failed += verdict != "OK"
        say(f"CASE {name} rank={rank} {verdict}")
    verdict = round_trip(comm)
    say(f"CASE round_trip_after_errors rank={rank} {verdict}")
    return 1 if failed or verdict != "OK" else 0


CASES_AND_ROUND_TRIP = ["round_trip_before_errors", *CASES, "round_trip_after_errors"]

if __name__ == "__main__":
    sys.exit(main())
