"""One rank's program for tests/faults/faults.py's Python cases: round trips of dispatch_v2 and
combine_v2 over MPI.COMM_WORLD, where rank CULPRIT, at its third, does MODE:
  exit   returns from the program (sys.exit(0)) without the call;
  extra  (after the last round trip) makes one more call, which no other rank makes;
  stop   SIGSTOPs itself (nobody resumes it);
  kill   SIGKILLs itself.
It prints "FAULT <time.time()>" on stdout just before. No rank catches an error: the traceback
and the interpreter's exit are what a user's program would see.

  mpirun -n 4 python tests/faults/fault_case.py MODE CULPRIT
"""

import os
import signal
import sys
import time

import torch
from mpi4py import MPI

from moe_ep.torch import distributed as D

MODE, CULPRIT = sys.argv[1], int(sys.argv[2])
comm = MPI.COMM_WORLD
rank, world = comm.Get_rank(), comm.Get_size()
E, K, H, BS = 2 * world, 2, 16, 8


def fault():
    print(f"FAULT {time.time():.6f}", flush=True)


def round_trip(i):
    g = torch.Generator().manual_seed(1000 * rank + i)
    x = torch.randn(BS, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(BS)]).to(torch.int32)
    scales = torch.rand(BS, K, generator=g)
    d = D.dispatch_v2(x, ids, group_ep=comm, ep_world_size=world, ep_rank_id=rank,
                      moe_expert_num=E, global_bs=BS * world)
    out = D.combine_v2(d.expand_x, ids, d.assist_info_for_combine, d.ep_recv_counts, scales,
                       group_ep=comm, ep_world_size=world, ep_rank_id=rank, moe_expert_num=E,
                       global_bs=BS * world)
    want = (x.unsqueeze(1) * scales.unsqueeze(2)).sum(1)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


for i in range(5):
    if rank == CULPRIT and i == 2:
        fault()
        if MODE == "exit":
            sys.exit(0)
        if MODE == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        if MODE == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
    round_trip(i)
if rank == CULPRIT and MODE == "extra":
    fault()
    round_trip(99)
