"""moe_ep.torch_npu takes exactly torch_npu's keyword names, defaults and argument order (the
signatures below are torch_npu's, as docs/spec.md states them from its documents). The ops
themselves run in mpi_autograd_cases.py (torch_npu_names, ascend_single_op_example)."""

from __future__ import annotations

import inspect

import pytest

torch_npu = pytest.importorskip("moe_ep.torch_npu")

SIGNATURES = {
    "npu_moe_distribute_dispatch_v2": (
        "x, expert_ids, group_ep, ep_world_size, ep_rank_id, moe_expert_num, *, scales=None, "
        "x_active_mask=None, expert_scales=None, elastic_info=None, performance_info=None, "
        "group_tp='', tp_world_size=0, tp_rank_id=0, expert_shard_type=0, shared_expert_num=1, "
        "shared_expert_rank_num=0, quant_mode=0, global_bs=0, expert_token_nums_type=1, "
        "comm_alg='', zero_expert_num=0, copy_expert_num=0, const_expert_num=0"
    ),
    "npu_moe_distribute_combine_v2": (
        "expand_x, expert_ids, assist_info_for_combine, ep_send_counts, expert_scales, group_ep, "
        "ep_world_size, ep_rank_id, moe_expert_num, *, tp_send_counts=None, x_active_mask=None, "
        "expand_scales=None, shared_expert_x=None, elastic_info=None, ori_x=None, "
        "const_expert_alpha_1=None, const_expert_alpha_2=None, const_expert_v=None, "
        "performance_info=None, group_tp='', tp_world_size=0, tp_rank_id=0, "
        "expert_shard_type=0, shared_expert_num=1, shared_expert_rank_num=0, global_bs=0, "
        "comm_quant_mode=0, comm_alg='', zero_expert_num=0, copy_expert_num=0, "
        "const_expert_num=0"
    ),
    "npu_moe_token_permute": "tokens, indices, num_out_tokens=None, padded_mode=False",
    "npu_moe_token_unpermute": (
        "permuted_tokens, sorted_indices, probs=None, padded_mode=False, restore_shape=None"
    ),
}


def _plain(fn) -> str:
    """The parameters as the documents write them: names, defaults, the '*' marker."""
    out, star = [], False
    for p in inspect.signature(fn).parameters.values():
        if p.kind is p.KEYWORD_ONLY and not star:
            out.append("*")
            star = True
        out.append(p.name if p.default is p.empty else f"{p.name}={p.default!r}")
    return ", ".join(out)


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_signature_is_torch_npus(name):
    assert _plain(getattr(torch_npu, name)) == SIGNATURES[name]


def test_unknown_group_name_is_refused_before_any_communication():
    import torch

    import moe_ep

    with pytest.raises(moe_ep.InvalidArgumentError, match="is not a registered group name"):
        torch_npu.npu_moe_distribute_dispatch_v2(
            torch.zeros(1, 4), torch.zeros(1, 1, dtype=torch.int32), "no-such-group", 1, 0, 1)


def test_register_group_refuses_a_name_taken_by_another_communicator():
    import moe_ep

    a, b = object(), object()
    torch_npu.register_group("test-name", a)
    with pytest.raises(moe_ep.InvalidArgumentError, match="names another communicator"):
        torch_npu.register_group("test-name", b)
    with pytest.raises(moe_ep.InvalidArgumentError, match="non-empty string"):
        torch_npu.register_group("", b)
