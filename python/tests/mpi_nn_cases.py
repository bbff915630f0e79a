"""moe_ep.torch.nn under mpirun (run by test_hf_models.py): ExpertParallel with uneven token counts
(a rank with 0 tokens included) against the same layer computed densely in one process with plain
PyTorch autograd, the world-size check, and Lockstep's rounds. Each rank prints
"CASE <name> rank=<r> OK|FAIL: ..." through mpi_report.say, then "DONE rank=<r> failed=<n>"."""

from __future__ import annotations

import sys
import traceback

import torch
from mpi4py import MPI

import moe_ep
from moe_ep.torch.nn import ExpertParallel, Lockstep, average_gradients
from mpi_report import say

H, K = 8, 2


def _experts(num: int):
    g = torch.Generator().manual_seed(7)
    return torch.randn(num, H, H, generator=g) / H**0.5


def _tokens(rank: int, world: int):
    """Rank r's tokens: 0 on rank 1, different counts elsewhere; every rank can make them all."""
    count = 0 if rank == 1 else 2 + 3 * rank
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(count, H, generator=g), count


def _routing(x, num: int, rank: int, world: int):
    """Distinct random ids per token, never rank 0's experts (0, 1) when W > 1: rank 0 receives
    no rows, so its experts get no gradient from backward."""
    g = torch.Generator().manual_seed(200 + rank)
    low = 2 if world > 1 else 0
    ids = torch.stack([low + torch.randperm(num - low, generator=g)[:K]
                       for _ in range(x.shape[0])]) \
        if x.shape[0] else torch.zeros(0, K, dtype=torch.long)
    w = torch.rand(x.shape[0], K, generator=g)
    return ids, w


def case_uneven_against_dense(comm):
    rank, world = comm.Get_rank(), comm.Get_size()
    num = 2 * world
    weights = _experts(num)
    mine = torch.nn.Parameter(weights[2 * rank:2 * rank + 2].clone())

    def run(x, counts):
        out, start = [], 0
        for l, n in enumerate(counts):
            out.append(x[start:start + n] @ mine[l])
            start += n
        return torch.cat(out)

    layer = ExpertParallel(num, run, comm)
    x, _ = _tokens(rank, world)
    x.requires_grad_()
    ids, w = _routing(x, num, rank, world)
    w.requires_grad_()
    y = layer(x, ids, w)
    (y * torch.arange(1.0, H + 1)).sum().backward()

    dense = weights.clone().requires_grad_()
    for r in range(world):
        xr, _ = _tokens(r, world)
        xr.requires_grad_()
        ids_r, w_r = _routing(xr, num, r, world)
        w_r.requires_grad_()
        yr = sum(w_r[:, k:k + 1] * torch.einsum("th,thg->tg", xr, dense[ids_r[:, k]])
                 for k in range(K)) if xr.shape[0] else xr.new_zeros(0, H)
        if xr.shape[0]:
            (yr * torch.arange(1.0, H + 1)).sum().backward()
        if r == rank:
            ref_y, ref_x, ref_w = yr.detach(), xr, w_r
    assert y.shape == ref_y.shape, (tuple(y.shape), tuple(ref_y.shape))
    torch.testing.assert_close(y.detach(), ref_y, rtol=1e-5, atol=1e-5)
    if x.shape[0]:
        torch.testing.assert_close(x.grad, ref_x.grad, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(w.grad, ref_w.grad, rtol=1e-5, atol=1e-5)
    assert (mine.grad is None) == (rank == 0 and world > 1), "rank 0's experts got no rows"
    # average_gradients: experts divided by W (None: zeros), replicated averaged over the ranks.
    shared = torch.nn.Parameter(torch.zeros(3))
    shared.grad = torch.full((3,), float(rank))
    average_gradients([shared, mine], comm, expert_params=[mine])
    torch.testing.assert_close(shared.grad, torch.full((3,), (world - 1) / 2))
    torch.testing.assert_close(mine.grad, dense.grad[2 * rank:2 * rank + 2] / world, rtol=1e-5,
                               atol=1e-5)


def case_world_does_not_divide(comm):
    world = comm.Get_size()
    num = 2 * world + 1 if world > 1 else 0  # every count divides by 1; 0 is not positive
    try:
        ExpertParallel(num, lambda x, c: x, comm)
    except moe_ep.InvalidArgumentError as e:
        text = str(e)
        assert f"num_experts = {num}" in text and f"{world} ranks" in text, text
        return
    raise AssertionError("no InvalidArgumentError")


def case_lockstep_rounds(comm):
    """Rank r runs r + 1 steps with r + 1 tokens each; finish() idles until the last rank is
    done, and the global_bs of each round is W * the largest count still running."""
    rank, world = comm.Get_rank(), comm.Get_size()
    step = Lockstep(comm)
    seen = []
    for _ in range(rank + 1):
        assert step.step(rank + 1)
        seen.append(step.global_bs)
    idle = step.finish(lambda: seen.append(step.global_bs))
    assert idle == world - 1 - rank, (idle, world, rank)
    assert seen == [world * world] * world, seen


def case_round_deadline(comm):
    """A rank that does not join a Lockstep round: the others raise moe_ep.TimeoutError at
    $MOE_EP_TIMEOUT_S instead of waiting. Rank 0 waits; the last rank joins 2 s later (so the
    round completes and the communicator stays usable)."""
    import os
    import time

    rank, world = comm.Get_rank(), comm.Get_size()
    sub = comm.Dup()
    step = Lockstep(sub)
    before = os.environ.get("MOE_EP_TIMEOUT_S")
    os.environ["MOE_EP_TIMEOUT_S"] = "0.5"
    try:
        if rank == world - 1:
            time.sleep(2)
            os.environ["MOE_EP_TIMEOUT_S"] = "30"
            step.step(1)
        elif rank == 0:
            try:
                step.step(1)
            except moe_ep.TimeoutError as e:
                assert "Lockstep.step: rank 0 waited 0.5 s" in str(e), str(e)
            else:
                raise AssertionError("no TimeoutError")
        else:
            os.environ["MOE_EP_TIMEOUT_S"] = "30"
            step.step(1)
    finally:
        if before is None:
            os.environ.pop("MOE_EP_TIMEOUT_S", None)
        else:
            os.environ["MOE_EP_TIMEOUT_S"] = before


CASES = [case_uneven_against_dense, case_world_does_not_divide, case_lockstep_rounds,
         case_round_deadline]
ONE_RANK = {"round_deadline"}  # needs a second rank


def case_names(world: int):
    return [c.__name__[len("case_"):] for c in CASES
            if world > 1 or c.__name__[len("case_"):] not in ONE_RANK]


def main() -> int:
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    failed = 0
    for case in CASES:
        name = case.__name__[len("case_"):]
        if name not in case_names(comm.Get_size()):
            continue
        try:
            case(comm)
            say(f"CASE {name} rank={rank} OK")
        except Exception as e:  # noqa: BLE001 - reported per case
            failed += 1
            detail = traceback.format_exc().strip().splitlines()[-1]
            say(f"CASE {name} rank={rank} FAIL: {type(e).__name__}: {detail}")
        comm.Barrier()
    say(f"DONE rank={rank} failed={failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
