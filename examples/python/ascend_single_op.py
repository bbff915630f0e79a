"""The single-op example ("单算子模式调用", "the seed" below) of torch_npu's
npu_moe_distribute_combine_v2 document (Ascend/op-plugin; docs/spec.md), ported to CPU by swapping
its import and its group set-up, then checked against a dense reference (the check is this port's
addition).

    mpirun -n 4 --oversubscribe python examples/python/ascend_single_op.py

What changed from the seed:
  - `import torch_npu` -> `import moe_ep.torch_npu as torch_npu` (and no torch.distributed);
  - the groups: MPI communicators split like the seed's dist.new_group calls, named with
    torch_npu.group_name() where the seed asks HCCL for its communicator names;
  - the processes: mpirun starts one per rank (the seed forks 16 with torch.multiprocessing), so
    dev_num is the MPI world size.
Everything else (the sizes, the expert_ids table, the warm-up dispatch, both calls and their
arguments) is the seed's; `.npu()` and `torch_npu.npu.set_device` are no-ops on CPU.
"""

import torch
import random
import numpy as np
from mpi4py import MPI

import moe_ep.torch_npu as torch_npu

# 控制模式 (the seed's settings)
quant_mode = 2  # 2为动态量化
is_dispatch_scales = True  # 动态量化可选择是否传scales
input_dtype = torch.bfloat16  # 输出dtype
server_num = 1
server_index = 0
dev_num = MPI.COMM_WORLD.Get_size()  # the seed: 16 NPUs
world_size = server_num * dev_num
rank_per_dev = int(world_size / server_num)
shared_expert_rank_num = 0  # 共享专家数
moe_expert_num = 32  # moe专家数
bs = 8  # token数量
h = 7168  # 每个token的长度
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


def gen_const_expert_alpha_1():
    return torch.empty(size=[const_expert_num, h], dtype=input_dtype).uniform_(-1, 1)


def gen_const_expert_alpha_2():
    return torch.empty(size=[const_expert_num, h], dtype=input_dtype).uniform_(-1, 1)


def gen_const_expert_v():
    return torch.empty(size=[const_expert_num, h], dtype=input_dtype).uniform_(-1, 1)


def get_new_group(rank):
    # The seed's groups, as MPI communicators: EP groups of the ranks i, i + T, ...; TP groups of
    # T consecutive ranks.
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

    # 创建输入tensor
    x = torch.randn(bs, h, dtype=input_dtype).npu()
    expert_ids = torch.tensor([[5, 7, 17, 4, 2, 6, 11, 16],
                               [10, 12, 13, 15, 19, 4, 18, 1],
                               [19, 33, 1, 17, 9, 5, 0, 32],
                               [19, 11, 17, 0, 10, 5, 7, 9],
                               [10, 16, 11, 17, 33, 8, 9, 3],
                               [12, 19, 5, 7, 1, 3, 18, 16],
                               [11, 9, 13, 16, 12, 33, 17, 14],
                               [16, 4, 9, 5, 0, 10, 11, 17]], dtype=torch.int32).npu()
    expert_scales = torch.randn(bs, k, dtype=torch.float32).npu()

    scales_shape = (1 + moe_expert_num, h) if shared_expert_rank_num else (moe_expert_num, h)
    if is_dispatch_scales:
        scales = torch.randn(scales_shape, dtype=torch.float32).npu()
    else:
        scales = None

    const_expert_alpha_1 = gen_const_expert_alpha_1().npu()
    const_expert_alpha_2 = gen_const_expert_alpha_2().npu()
    const_expert_v = gen_const_expert_v().npu()

    out = warm_up_dispatch(rank, ep_hcomm_info, tp_hcomm_info)

    expand_x, dynamic_scales, assist_info_for_combine, expert_token_nums, ep_recv_counts, tp_recv_counts, expand_scales = torch_npu.npu_moe_distribute_dispatch_v2(
        x=x,
        expert_ids=expert_ids,
        group_ep=ep_hcomm_info,
        group_tp=tp_hcomm_info,
        ep_world_size=ep_world_size,
        tp_world_size=tp_world_size,
        ep_rank_id=rank // tp_world_size,
        tp_rank_id=rank % tp_world_size,
        expert_shard_type=0,
        shared_expert_rank_num=shared_expert_rank_num,
        moe_expert_num=moe_expert_num,
        scales=scales,
        quant_mode=quant_mode,
        global_bs=globalBS,
        zero_expert_num=zero_expert_num,
        copy_expert_num=copy_expert_num,
        const_expert_num=const_expert_num)

    if is_quant:
        expand_x = expand_x.to(input_dtype)

    x_out = torch_npu.npu_moe_distribute_combine_v2(expand_x=expand_x,
                                                    expert_ids=expert_ids,
                                                    assist_info_for_combine=assist_info_for_combine,
                                                    ep_send_counts=ep_recv_counts,
                                                    tp_send_counts=tp_recv_counts,
                                                    expert_scales=expert_scales,
                                                    group_ep=ep_hcomm_info,
                                                    group_tp=tp_hcomm_info,
                                                    ep_world_size=ep_world_size,
                                                    tp_world_size=tp_world_size,
                                                    ep_rank_id=rank // tp_world_size,
                                                    tp_rank_id=rank % tp_world_size,
                                                    expert_shard_type=0,
                                                    shared_expert_rank_num=shared_expert_rank_num,
                                                    moe_expert_num=moe_expert_num,
                                                    global_bs=globalBS,
                                                    ori_x=x,
                                                    const_expert_alpha_1=const_expert_alpha_1,
                                                    const_expert_alpha_2=const_expert_alpha_2,
                                                    const_expert_v=const_expert_v,
                                                    zero_expert_num=zero_expert_num,
                                                    copy_expert_num=copy_expert_num,
                                                    const_expert_num=const_expert_num)
    print(f'rank {rank} epid {rank // tp_world_size} tpid {rank % tp_world_size} npu finished! \n')
    return x, expert_ids, expert_scales, scales, x_out


def dense_reference(x, expert_ids, expert_scales, scales):
    """This port's check, from SPEC §1.5 and §2.2-2.3 on this rank's tokens alone: the seed's
    experts are the identity on the int8 rows cast to bf16, so entry (i, k) for MoE expert e
    contributes w * q with q = rne(x_i * scales[e] * 127 / max|x_i * scales[e]|); the zero expert
    (id 32) nothing, the copy expert (33) w * x_i; summed in fp32 in k order, rounded to bf16."""
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
        print("shared_expert_rank_num 不能大于 ep_world_size")
        exit(0)
    if shared_expert_rank_num > 0 and ep_world_size % shared_expert_rank_num != 0:
        print("ep_world_size 必须是 shared_expert_rank_num的整数倍")
        exit(0)
    if moe_expert_num % moe_rank_num != 0:
        print("moe_expert_num 必须是 moe_rank_num 的整数倍")
        exit(0)
    torch.manual_seed(1000 + rank)  # the seed's processes draw their own inputs
    x, expert_ids, expert_scales, scales, x_out = run_npu_process(rank)
    ok = torch.equal(x_out, dense_reference(x, expert_ids, expert_scales, scales))
    oks = MPI.COMM_WORLD.allgather(ok)
    if rank == 0:
        print("run npu success.")
        print("PASS: every rank's combine output equals the dense reference bit for bit"
              if all(oks) else f"FAIL: ranks {[r for r, o in enumerate(oks) if not o]} differ")
    exit(0 if all(oks) else 1)
