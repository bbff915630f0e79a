"""The graph-mode example ("图模式调用", "the seed" below) of torch_npu's
npu_moe_distribute_combine_v2 document (Ascend/op-plugin; docs/spec.md), ported to CPU by swapping
its imports, its group set-up and its graph backend, then checked against a dense reference (the
check is this port's addition).

    mpirun -n 4 --oversubscribe python examples/python/ascend_graph_mode.py
    mpirun -n 4 --oversubscribe python examples/python/ascend_graph_mode.py --backend inductor

What changed from the seed:
  - `import torch_npu` -> `import moe_ep.torch_npu as torch_npu` (and no torch.distributed);
    `import torchair` is gone: torchair.get_npu_backend() becomes get_npu_backend() below, which
    hands the graph to a stock torch.compile backend ("aot_eager" and "inductor", each in turn by
    default; --backend picks one), and the model is compiled with fullgraph=True (the seed's graph
    is static, "仅支持静态图": a graph break would be an error);
  - the groups: MPI communicators split like the seed's dist.new_group calls, named with
    torch_npu.group_name() where the seed asks HCCL for its communicator names;
  - the processes: mpirun starts one per rank (the seed forks 16 with torch.multiprocessing), so
    dev_num is the MPI world size; the seed's closing time.sleep(10) is left out (nothing runs
    asynchronously here).
Everything else (the sizes, the expert_ids table, the warm-up dispatch, the model and its
arguments, `model.npu()`, `torch.npu.synchronize()`) is the seed's: importing moe_ep.torch_npu
makes the device calls no-ops on CPU.
"""

# 仅支持静态图 (static graphs only)
import argparse
import torch
import random
import numpy as np
import time
from mpi4py import MPI

import moe_ep.torch_npu as torch_npu

# 控制模式 (the seed's settings)
quant_mode = 2  # 2为动态量化 (2: dynamic quantisation)
is_dispatch_scales = True  # 动态量化可选择是否传scales (dynamic quantisation may pass scales)
input_dtype = torch.bfloat16  # 输出dtype (the output dtype)
server_num = 1
server_index = 0
dev_num = MPI.COMM_WORLD.Get_size()  # the seed: 16 NPUs
world_size = server_num * dev_num
rank_per_dev = int(world_size / server_num)  # 每个host有几个die (dies per host)
shared_expert_rank_num = 0  # 共享专家数 (shared-expert ranks)
moe_expert_num = 32  # moe专家数 (MoE experts)
bs = 8  # token数量 (tokens)
h = 7168  # 每个token的长度 (the length of each token)
k = 8
random_seed = 0
tp_world_size = 1
ep_world_size = int(world_size / tp_world_size)
moe_rank_num = ep_world_size - shared_expert_rank_num
local_moe_expert_num = moe_expert_num // moe_rank_num
globalBS = bs * ep_world_size
is_shared = (shared_expert_rank_num > 0)
is_quant = (quant_mode > 0)

zero_expert_num = 1
copy_expert_num = 1
const_expert_num = 1

BACKENDS = ("aot_eager", "inductor")
backend_name = BACKENDS[0]  # set per run in __main__
compiled_graphs = []  # the graphs the backend was given (this port's check that it compiled)


def get_npu_backend():
    """Stands in for torchair.get_npu_backend(): a torch.compile backend that records the graph
    and compiles it with the stock backend backend_name."""
    from torch._dynamo import lookup_backend

    def npu_backend(gm, example_inputs):
        compiled_graphs.append(gm)
        return lookup_backend(backend_name)(gm, example_inputs)

    return npu_backend


class MOE_DISTRIBUTE_GRAPH_Model(torch.nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x, expert_ids, group_ep, group_tp, ep_world_size, tp_world_size,
                ep_rank_id, tp_rank_id, expert_shard_type, shared_expert_rank_num, moe_expert_num,
                scales, quant_mode, global_bs, expert_scales, elastic_info, const_expert_alpha_1,
                const_expert_alpha_2, const_expert_v, zero_expert_num, copy_expert_num,
                const_expert_num):
        output_dispatch_npu = torch_npu.npu_moe_distribute_dispatch_v2(
            x=x,
            expert_ids=expert_ids,
            group_ep=group_ep,
            group_tp=group_tp,
            ep_world_size=ep_world_size,
            tp_world_size=tp_world_size,
            ep_rank_id=ep_rank_id,
            tp_rank_id=tp_rank_id,
            expert_shard_type=expert_shard_type,
            shared_expert_rank_num=shared_expert_rank_num,
            moe_expert_num=moe_expert_num,
            scales=scales,
            quant_mode=quant_mode,
            global_bs=global_bs,
            elastic_info=elastic_info,
            zero_expert_num=zero_expert_num,
            copy_expert_num=copy_expert_num,
            const_expert_num=const_expert_num
        )

        expand_x_npu, _, assist_info_for_combine_npu, _, ep_recv_counts_npu, tp_recv_counts_npu, expand_scales = output_dispatch_npu
        if expand_x_npu.dtype == torch.int8:
            expand_x_npu = expand_x_npu.to(input_dtype)

        output_combine_npu = torch_npu.npu_moe_distribute_combine_v2(
            expand_x=expand_x_npu,
            expert_ids=expert_ids,
            assist_info_for_combine=assist_info_for_combine_npu,
            ep_send_counts=ep_recv_counts_npu,
            tp_send_counts=tp_recv_counts_npu,
            expert_scales=expert_scales,
            group_ep=group_ep,
            group_tp=group_tp,
            ep_world_size=ep_world_size,
            tp_world_size=tp_world_size,
            ep_rank_id=ep_rank_id,
            tp_rank_id=tp_rank_id,
            expert_shard_type=expert_shard_type,
            shared_expert_rank_num=shared_expert_rank_num,
            moe_expert_num=moe_expert_num,
            global_bs=global_bs,
            elastic_info=elastic_info,
            ori_x=x,
            const_expert_alpha_1=const_expert_alpha_1,
            const_expert_alpha_2=const_expert_alpha_2,
            const_expert_v=const_expert_v,
            zero_expert_num=zero_expert_num,
            copy_expert_num=copy_expert_num,
            const_expert_num=const_expert_num
        )
        x = output_combine_npu
        x_combine_res = output_combine_npu
        return [x_combine_res, output_combine_npu]


def gen_const_expert_alpha_1():
    const_expert_alpha_1 = torch.empty(size=[const_expert_num, h], dtype=input_dtype).uniform_(-1, 1)
    return const_expert_alpha_1


def gen_const_expert_alpha_2():
    const_expert_alpha_2 = torch.empty(size=[const_expert_num, h], dtype=input_dtype).uniform_(-1, 1)
    return const_expert_alpha_2


def gen_const_expert_v():
    const_expert_v = torch.empty(size=[const_expert_num, h], dtype=input_dtype).uniform_(-1, 1)
    return const_expert_v


def get_new_group(rank):
    # The seed's groups, as MPI communicators: EP groups of the ranks i, i + T, ... (如果
    # tp_world_size = 2，ep_world_size = 8，则为 [[0, 2, ..., 14], [1, 3, ..., 15]]); TP groups of
    # T consecutive ranks ([[0, 1], [2, 3], ..., [14, 15]]).
    world = MPI.COMM_WORLD
    ep_group = world.Split(color=rank % tp_world_size, key=rank)
    tp_group = world.Split(color=rank // tp_world_size, key=rank)
    return ep_group, tp_group


def get_hcomm_info(rank, comm_group):
    return torch_npu.group_name(comm_group)


def warm_up_dispatch(rank, group_ep, group_tp):
    x_warm_up = torch.empty(size=[1, h], dtype=input_dtype).uniform_(-1024, 1024).to(input_dtype).npu()
    expert_ids_warm_up = torch.arange(0, k, dtype=torch.int32).unsqueeze(0).npu()

    dispatch_kwargs_before = get_dispatch_kwargs_warmup(
        x_warm_up=x_warm_up,
        expert_ids_warm_up=expert_ids_warm_up,
        group_ep=group_ep,
        group_tp=group_tp,
        ep_rank_id=rank // tp_world_size,
        tp_rank_id=rank % tp_world_size,
    )

    (
        expand_x, dynamic_scales, expand_idx,
        expert_token_nums, ep_recv_counts, tp_recv_counts, _
    ) = torch_npu.npu_moe_distribute_dispatch_v2(**dispatch_kwargs_before)
    return expand_x, dynamic_scales, expand_idx, expert_token_nums, ep_recv_counts, tp_recv_counts


def get_dispatch_kwargs_warmup(
    x_warm_up, expert_ids_warm_up, group_ep, group_tp, ep_rank_id, tp_rank_id,
):
    x_warm_up = x_warm_up.to(input_dtype).npu()
    expert_ids_warm_up = expert_ids_warm_up.to(torch.int32).npu()

    return {
        'x': x_warm_up,
        'expert_ids': expert_ids_warm_up,
        'x_active_mask': None,
        'group_ep': group_ep,
        'group_tp': group_tp,
        'ep_rank_id': ep_rank_id,
        'tp_rank_id': tp_rank_id,
        'ep_world_size': ep_world_size,
        'tp_world_size': tp_world_size,
        'expert_shard_type': 0,
        'shared_expert_num': 0,
        'shared_expert_rank_num': shared_expert_rank_num,
        'moe_expert_num': moe_expert_num,
        'scales': None,
        'quant_mode': 2,
        'global_bs': 16,
    }


def run_npu_process(rank):
    torch_npu.npu.set_device(rank)
    rank = rank + 16 * server_index
    ep_group, tp_group = get_new_group(rank)
    ep_hcomm_info = get_hcomm_info(rank, ep_group)
    tp_hcomm_info = get_hcomm_info(rank, tp_group)

    # 创建输入tensor (the inputs)
    x = torch.randn(bs, h, dtype=input_dtype).npu()
    expert_ids = torch.tensor([
        [0, 8, 4, 1, 6, 12, 14, 17],
        [14, 10, 7, 3, 0, 12, 11, 17],
        [12, 0, 5, 11, 19, 4, 6, 18],
        [17, 3, 4, 10, 18, 0, 1, 2],
        [13, 16, 9, 10, 15, 6, 7, 14],
        [17, 15, 14, 8, 16, 18, 3, 12],
        [4, 12, 2, 17, 15, 3, 9, 10],
        [16, 7, 12, 9, 18, 3, 19, 17]
    ], dtype=torch.int32).npu()
    expert_scales = torch.randn(bs, k, dtype=torch.float32).npu()
    scales_shape = (1 + moe_expert_num, h) if shared_expert_rank_num else (moe_expert_num, h)
    if is_dispatch_scales:
        scales = torch.randn(scales_shape, dtype=torch.float32).npu()
    else:
        scales = None

    elastic_info = None
    const_expert_alpha_1 = gen_const_expert_alpha_1().npu()
    const_expert_alpha_2 = gen_const_expert_alpha_2().npu()
    const_expert_v = gen_const_expert_v().npu()

    out = warm_up_dispatch(rank, ep_hcomm_info, tp_hcomm_info)

    model = MOE_DISTRIBUTE_GRAPH_Model()
    model = model.npu()
    npu_backend = get_npu_backend()  # the seed: torchair.get_npu_backend()
    model = torch.compile(model, backend=npu_backend, dynamic=False, fullgraph=True)
    output = model.forward(
        x, expert_ids, ep_hcomm_info, tp_hcomm_info, ep_world_size, tp_world_size,
        rank // tp_world_size, rank % tp_world_size, 0, shared_expert_rank_num, moe_expert_num, scales,
        quant_mode, globalBS, expert_scales, elastic_info, const_expert_alpha_1, const_expert_alpha_2, const_expert_v,
        zero_expert_num, copy_expert_num, const_expert_num
    )
    torch.npu.synchronize()
    print(f'rank {rank} epid {rank // tp_world_size} tpid {rank % tp_world_size} npu finished! \n')
    return x, expert_ids, expert_scales, scales, output


def dense_reference(x, expert_ids, expert_scales, scales):
    """This port's check, from SPEC §1.5 and §2.2-2.3 on this rank's tokens alone: the seed's
    experts are the identity on the int8 rows cast to bf16, so entry (i, k) for MoE expert e
    contributes w * q with q = rne(x_i * scales[e] * 127 / max|x_i * scales[e]|); (the zero
    expert, id 32, would contribute nothing, the copy expert, 33, w * x_i: the seed's graph-mode
    table routes to neither); summed in fp32 in k order, rounded to bf16."""
    acc = torch.zeros(bs, h)
    for kk in range(k):
        e = expert_ids[:, kk].long()
        w = expert_scales[:, kk : kk + 1]
        moe = e < moe_expert_num
        xf = x.float() * scales[e.clamp(max=moe_expert_num - 1)]
        # s = 127 / max|xf| as one fp32 division (SPEC §1.5): not `127 / tensor`, which torch
        # computes as reciprocal(tensor) * 127, one ulp off for about a quarter of the rows
        s_ = torch.tensor(127.0) / xf.abs().amax(dim=1, keepdim=True)
        q = torch.round(xf * s_)
        y = torch.where(moe[:, None], q.to(input_dtype).float(), x.float())
        term = torch.where((e == moe_expert_num)[:, None], torch.zeros(()), w * y)
        acc = acc + term
    return acc.to(input_dtype)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=BACKENDS, action="append",
                        help="the stock torch.compile backend (repeatable; default: both)")
    backends = parser.parse_args().backend or list(BACKENDS)
    rank = MPI.COMM_WORLD.Get_rank()
    if rank == 0:
        print(f"bs={bs}")
        print(f"global_bs={globalBS}")
        print(f"shared_expert_rank_num={shared_expert_rank_num}")
        print(f"moe_expert_num={moe_expert_num}")
        print(f"k={k}")
        print(f"quant_mode={quant_mode}", flush=True)
        print(f"local_moe_expert_num={local_moe_expert_num}", flush=True)
        print(f"tp_world_size={tp_world_size}", flush=True)
        print(f"ep_world_size={ep_world_size}", flush=True)

    if tp_world_size != 1 and local_moe_expert_num > 1:
        print("unSupported tp = 2 and local moe > 1")
        exit(0)

    if shared_expert_rank_num > ep_world_size:
        print("shared_expert_rank_num 不能大于 ep_world_size")  # may not exceed ep_world_size
        exit(0)

    if shared_expert_rank_num > 0 and ep_world_size % shared_expert_rank_num != 0:
        print("ep_world_size 必须是 shared_expert_rank_num的整数倍")  # must be a multiple of it
        exit(0)

    if moe_expert_num % moe_rank_num != 0:
        print("moe_expert_num 必须是 moe_rank_num 的整数倍")  # must be a multiple of moe_rank_num
        exit(0)

    failed = []
    for backend_name in backends:
        torch.manual_seed(1000 + rank)  # the seed's processes draw their own inputs
        torch._dynamo.reset()  # a fresh compilation for each backend
        del compiled_graphs[:]
        t0 = time.perf_counter()
        x, expert_ids, expert_scales, scales, output = run_npu_process(rank)
        want = dense_reference(x, expert_ids, expert_scales, scales)
        ok = (len(compiled_graphs) == 1 and len(output) == 2
              and all(torch.equal(o, want) for o in output))
        oks = MPI.COMM_WORLD.allgather(ok)
        if not all(oks):
            failed.append(backend_name)
        if rank == 0:
            print(f"{backend_name}: {'OK' if all(oks) else 'FAIL'} "
                  f"({time.perf_counter() - t0:.1f} s, ranks differing: "
                  f"{[r for r, o in enumerate(oks) if not o]})", flush=True)
    if rank == 0:
        print("run npu success.")
        print(f"PASS: the model compiled as one graph (fullgraph) with {' and '.join(backends)}; "
              "every rank's combine outputs equal the dense reference bit for bit"
              if not failed else f"FAIL: backends {failed} differ from the dense reference")
    exit(0 if not failed else 1)
