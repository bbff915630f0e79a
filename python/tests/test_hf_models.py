"""Hugging Face transformers MoE models expert-parallel through moe-ep (issue 31): the two examples
that check themselves (examples/python/hf_generate.py, hf_train.py) under mpirun at several world
sizes and for every family make_checkpoint writes, moe_ep.torch.nn's cases (mpi_nn_cases.py), and
the experts implementation's errors in one process.

The examples' oracle is single-process transformers with its stock experts implementation on the
same prompts (generate) or the concatenated batch (train). Needs mpirun, mpi4py and transformers
(pip install .[transformers]); skipped without them, failed under CI.
"""

from __future__ import annotations

import functools
import importlib.util
import re

import pytest

from needs import missing
from test_dispatch_mpi import HERE, ROOT, _mpirun, _tail

import mpi_nn_cases  # noqa: E402  (its case names)

if importlib.util.find_spec("transformers") is None:
    missing("transformers is not installed (pip install .[transformers])")

EXAMPLES = ROOT / "examples" / "python"


def _example(world: int, script: str, *args: str):
    proc = _mpirun(world, str(EXAMPLES / script), *args)
    out = proc.stdout + proc.stderr
    lines = [l for l in proc.stdout.splitlines() if l.startswith(("PASS", "FAIL"))]
    assert lines and lines[-1].startswith("PASS") and proc.returncode == 0, _tail(out)
    return proc.stdout


def test_generate_qwen3_moe_w1():
    """Greedy generation, fp32: the tokens equal single-process transformers'."""
    out = _example(1, "hf_generate.py", "--model", "qwen3-moe")
    assert out.count("tokens equal") == 1, _tail(out)


def test_generate_qwen3_moe_w2_fp32_and_bf16():
    """fp32: every rank's tokens equal the stock model's; bf16: the first step's logits are as
    close to fp32's as stock bf16's are."""
    out = _example(2, "hf_generate.py", "--model", "qwen3-moe", "--dtype", "fp32,bf16")
    assert out.count("tokens equal") == 2 and out.count("first-step logits") == 2, _tail(out)


def test_generate_every_family_w4():
    """Qwen3-MoE, Mixtral, OLMoE, DeepSeek-V3 (shared experts outside the experts module) and
    GPT-OSS (biases, transposed weights, its own gate) at W 4, one launch."""
    families = ["qwen3-moe", "mixtral", "olmoe", "deepseek-v3", "gpt-oss"]
    out = _example(4, "hf_generate.py", "--model", ",".join(families))
    assert out.count("tokens equal") == 4 * len(families), _tail(out)
    for family in families:
        assert f"/{family}, fp32" in out, _tail(out)


def test_generate_idle_rank_and_uneven_lengths():
    """Rank 2 has no prompts and the others generate 32, 29 and 23 tokens: no hang, and the
    tokens still equal the stock model's."""
    out = _example(4, "hf_generate.py", "--idle-rank", "2", "--new-tokens-step", "3")
    assert out.count("tokens equal") == 3 and "no prompts" in out, _tail(out)


def test_train_w4_adamw_and_sgd():
    """20 AdamW steps = one process on the concatenated batch; then SGD, which (unlike AdamW)
    moves by the gradient's size, so wrongly scaled expert gradients fail it, on a model that
    transformers' own from_pretrained loaded whole with experts_implementation="moe_ep" (cut to
    this rank's experts at the first forward, after the optimizer took its parameters). Odd ranks
    hold one sequence more (the losses weighted by token_weight)."""
    out = _example(4, "hf_train.py", "--optimizer", "adamw,sgd", "--lr", "1e-3,0.1",
                   "--loader", "moe_ep,stock", "--uneven")
    assert out.count("\nPASS\n") == 2 and "adamw lr" in out and "sgd lr" in out, _tail(out)


@functools.lru_cache(maxsize=None)
def _nn_launch(world: int):
    proc = _mpirun(world, str(HERE / "mpi_nn_cases.py"))
    results: dict = {}
    for m in re.finditer(r"^CASE (\S+) rank=(\d+) (OK|FAIL: .*)$", proc.report, re.M):
        results.setdefault(m.group(1), {})[int(m.group(2))] = m.group(3)
    return proc, results


@pytest.mark.parametrize("world", [1, 3])
def test_nn_launch_completes(world):
    proc, _ = _nn_launch(world)
    done = re.findall(r"^DONE rank=(\d+) failed=\d+$", proc.report, re.M)
    assert sorted(int(r) for r in done) == list(range(world)), _tail(proc.stdout + proc.stderr)
    assert proc.returncode == 0, _tail(proc.stdout + proc.stderr)


@pytest.mark.parametrize("world,case", [(w, c) for w in (1, 3)
                                        for c in mpi_nn_cases.case_names(w)])
def test_nn_case(world, case):
    proc, results = _nn_launch(world)
    got = results.get(case, {})
    assert sorted(got) == list(range(world)), _tail(proc.stdout + proc.stderr)
    failed = {r: v for r, v in got.items() if v != "OK"}
    assert not failed, failed


def test_unrecognised_experts_module():
    """An experts module without the parameters its flags promise is refused, naming them."""
    import torch
    from transformers.integrations.moe import use_experts_implementation

    import moe_ep
    import moe_ep.transformers as mt

    @use_experts_implementation
    class Odd(torch.nn.Module):
        def __init__(self, config):
            super().__init__()
            self.num_experts = 4
            self.gate_up_proj = torch.nn.Parameter(torch.zeros(4, 8, 4))
            self.w2 = torch.nn.Parameter(torch.zeros(4, 4, 4))  # not down_proj

        def forward(self, hidden_states, top_k_index, top_k_weights):
            return hidden_states

    class Config:
        _experts_implementation = "moe_ep"

    odd = Odd(Config())
    with pytest.raises(moe_ep.UnsupportedError, match="down_proj"):
        mt.shard_experts(torch.nn.ModuleList([odd]))
    with pytest.raises(moe_ep.UnsupportedError, match="down_proj"):
        odd(torch.zeros(2, 4), torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1))


def test_expert_id_out_of_range():
    import torch
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    import moe_ep
    import moe_ep.transformers as mt

    config = Qwen3MoeConfig(hidden_size=8, moe_intermediate_size=4, num_experts=4,
                            num_experts_per_tok=2)
    config._experts_implementation = "moe_ep"
    experts = Qwen3MoeExperts(config)
    mt.shard_experts(torch.nn.ModuleList([experts]))
    # dispatch_v2's check, made on every rank (one rank's bad ids: RemoteError on the others,
    # python/tests/mpi_dispatch_cases.py bad_expert_id_on_one_rank)
    with pytest.raises(moe_ep.InvalidArgumentError,
                       match=r"dispatch_v2: expert_ids\[0,1\] = 4 is outside \[0, 4\)"):
        experts(torch.zeros(1, 8), torch.tensor([[0, 4]]), torch.ones(1, 2))


def test_setup_installs_the_pinned_transformers():
    """scripts/setup.sh installs the transformers version pyproject.toml's extra pins."""
    import tomllib

    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["transformers"]
    pin = next(d for d in extra if d.startswith("transformers=="))
    assert pin in (ROOT / "scripts" / "setup.sh").read_text(), pin


@pytest.mark.parametrize("value", ["abc", "-1", "0", "nan"])
def test_bad_timeout_is_refused(monkeypatch, value):
    """The rounds' deadline comes from $MOE_EP_TIMEOUT_S; a value that is not a positive number
    is an error naming it, not a deadline of 300 s or of 0."""
    import moe_ep
    from moe_ep.torch.nn import _deadline_s

    monkeypatch.setenv("MOE_EP_TIMEOUT_S", value)
    with pytest.raises(moe_ep.InvalidArgumentError, match=f"MOE_EP_TIMEOUT_S = '{value}' must be"):
        _deadline_s()


def test_rss_at_qwen3_30b_widths(tmp_path):
    """Issue 31's memory bound: a Qwen3-30B-A3B-wide checkpoint (2 layers: H 2048, 128 experts,
    top-8, expert FFN 768, vocab 151936; bf16, 3.6 GiB) loaded at W 4 by
    moe_ep.transformers.from_pretrained: each rank's peak RSS up to the end of loading is within
    1.2x of the weights it holds (non-expert + 1/4 of the experts), interpreter included."""
    import subprocess
    import sys

    path = tmp_path / "qwen3-30b-a3b-2l"
    subprocess.run([sys.executable, "-m", "moe_ep.transformers.make_checkpoint", "--model",
                    "qwen3-moe", "--layers", "2", "--dtype", "bf16", "--out", str(path)],
                   check=True, capture_output=True)
    out = _example(4, "hf_generate.py", "--checkpoint", str(path), "--dtype", "bf16",
                   "--no-reference", "--rss-bound", "1.2", "--new-tokens", "4", "--prompts", "1")
    assert out.count("(bound 1.2)") == 4, _tail(out)


def test_side_by_side_smoke():
    """scripts/hf-side-by-side.sh --smoke (docs/performance.md's side by side at tiny sizes, W 2):
    every row group runs (transformers single-process and its own expert parallelism, the gloo
    all-to-all dispatcher, moe-ep shm and mpi) and each row's greedy tokens equal single-process
    transformers'; the script exits 1 otherwise."""
    import os
    import subprocess
    import sys

    proc = subprocess.run([str(ROOT / "scripts" / "hf-side-by-side.sh"), "--smoke"], cwd=ROOT,
                          env=dict(os.environ, PYTHON=sys.executable), capture_output=True,
                          text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, _tail(out)
    assert "moe-ep" in out and out.count(" | yes") >= 6 and " | no" not in out, _tail(out)
