"""moe_ep.transformers.from_pretrained (each rank reads only its experts from a safetensors
checkpoint) and make_checkpoint (issue 31).

The checkpoints are written once per module with make_checkpoint --small (qwen3-moe: legacy
per-expert tensors, MergeModulelist + Concatenate; gpt-oss: fused, biased, transposed experts).
The oracle is transformers' own AutoModelForCausalLM.from_pretrained of the same checkpoint in
one process: every non-expert parameter equal, every local expert parameter equal to the
matching rows of the whole one, and the forward's logits equal within fp32 rounding. The bad
inputs (a checkpoint missing an expert tensor, ranks loading different checkpoints, a world size
that does not divide the experts, missing files, an operation moe_ep cannot slice) must raise the
named moe_ep error on every rank.

This file is also the case script: run under mpirun as __main__ (one launch per world size runs
every case; each rank prints "CASE name rank=r OK" or "FAIL: ..."). Needs mpirun, mpi4py and
transformers; skipped without them, failed under CI (needs.py).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import shutil
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

# The checkpoints in the folder handed to the case script (written by the fixture below).
QWEN3, QWEN3_SEED1, GPT_OSS = "qwen3", "qwen3-seed1", "gpt-oss"
TIED_SHARDED, EXPERTS3, MISSING_EXPERT, NO_WEIGHTS = "tied-sharded", "experts3", \
    "missing-expert", "no-weights"
DROPPED = "model.layers.1.mlp.experts.5.up_proj.weight"  # what MISSING_EXPERT lacks
TOL = dict(rtol=1e-5, atol=1e-5)  # fp32: moe-ep's combine sums in another order than the stock loop


# ------------------------------------------------------------------------------------------
# The cases (under mpirun)


def _load_and_compare(comm, path: str, *, bytes_exact: bool = True) -> None:
    """from_pretrained against transformers' whole model: parameters and a forward."""
    import torch
    from transformers import AutoModelForCausalLM

    import moe_ep.transformers as mt

    rank, world = comm.Get_rank(), comm.Get_size()
    model = mt.from_pretrained(path, comm, dtype=torch.float32)
    stock = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert not model.training and model.config._experts_implementation == "moe_ep"
    mine, whole = model.state_dict(), stock.state_dict()
    assert set(mine) == set(whole), sorted(set(mine) ^ set(whole))
    expert_names = {}
    for name, module in mt.experts_modules(model):
        for p in mt.expert_param_names(module):
            expert_names[f"{name}.{p}"] = module.num_experts
    assert expert_names, "no experts parameters"
    for name, ref in whole.items():
        got = mine[name]
        if name in expert_names:
            local = expert_names[name] // world
            assert got.shape[0] == local, f"{name}: {tuple(got.shape)}, {local} local experts"
            ref = ref[rank * local:(rank + 1) * local]
        assert got.dtype == ref.dtype and torch.equal(got, ref), f"{name} differs"
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    sizes = json.loads(Path(path, "moe_ep_sizes.json").read_text())
    scale = 4 // {"fp32": 4, "bf16": 2}[sizes["dtype"]]  # loaded as fp32
    assert model.moe_ep_bytes["local_expert"] == sizes["expert_bytes"] * scale // world, \
        (model.moe_ep_bytes, sizes)
    if bytes_exact:
        assert model.moe_ep_bytes["non_expert"] == sizes["non_expert_bytes"] * scale, \
            (model.moe_ep_bytes, sizes)
    # Each rank its own batch, of its own length.
    g = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(0, model.config.vocab_size, (2, 3 + 2 * rank), generator=g)
    with torch.no_grad():
        got = model(ids).logits
        ref = stock(ids).logits
    torch.testing.assert_close(got, ref, **TOL)


def _expect(kind, call, *needles: str) -> None:
    """call() raises kind (a moe_ep error class) whose message holds every needle."""
    try:
        call()
    except kind as e:
        message = str(e)
        lacking = [n for n in needles if n not in message]
        assert not lacking, f"the message lacks {lacking}: {message}"
        return
    raise AssertionError(f"no {kind.__name__} raised")


def case_load_qwen3(comm, folder):
    _load_and_compare(comm, os.path.join(folder, QWEN3))


def case_load_gpt_oss(comm, folder):
    _load_and_compare(comm, os.path.join(folder, GPT_OSS))


def case_load_tied_sharded_bf16(comm, folder):
    """Tied embeddings (lm_head not in the checkpoint), two shards and an index, bf16 on disk
    loaded as fp32."""
    _load_and_compare(comm, os.path.join(folder, TIED_SHARDED), bytes_exact=False)


def case_missing_expert(comm, folder):
    from moe_ep import InvalidArgumentError
    import moe_ep.transformers as mt

    _expect(InvalidArgumentError,
            lambda: mt.from_pretrained(os.path.join(folder, MISSING_EXPERT), comm),
            DROPPED, "expert 5", "model.layers.1.mlp.experts.gate_up_proj")


def case_different_checkpoints(comm, folder):
    from moe_ep import InvalidArgumentError
    import moe_ep.transformers as mt
    from moe_ep.transformers._loader import open_checkpoint

    paths = [os.path.join(folder, QWEN3), os.path.join(folder, QWEN3_SEED1)]
    hashes = [open_checkpoint(p).fingerprint[:16] for p in paths]
    mine = paths[1] if comm.Get_rank() == 1 else paths[0]
    _expect(InvalidArgumentError, lambda: mt.from_pretrained(mine, comm),
            "different checkpoints", "rank 0", "rank 1", hashes[0], hashes[1], QWEN3_SEED1)


def case_world_size_not_dividing(comm, folder):
    from moe_ep import InvalidArgumentError
    import moe_ep.transformers as mt

    world = comm.Get_size()
    _expect(InvalidArgumentError,
            lambda: mt.from_pretrained(os.path.join(folder, EXPERTS3), comm),
            "num_experts = 3", f"{world} ranks")


def case_missing_files(comm, folder):
    from moe_ep import InvalidArgumentError
    import moe_ep.transformers as mt

    _expect(InvalidArgumentError,
            lambda: mt.from_pretrained(os.path.join(folder, NO_WEIGHTS), comm),
            "neither model.safetensors nor model.safetensors.index.json", NO_WEIGHTS)


def case_missing_folder_on_one_rank(comm, folder):
    """Only rank 1 names a folder that does not exist: every rank raises, naming it."""
    from moe_ep import InvalidArgumentError
    import moe_ep.transformers as mt

    path = os.path.join(folder, QWEN3 if comm.Get_rank() != 1 else "nowhere")
    needles = ["does not exist or is not a folder", "nowhere"]
    if comm.Get_rank() != 1:
        needles.append("rank 1 failed")
    _expect(InvalidArgumentError, lambda: mt.from_pretrained(path, comm), *needles)


def case_unsupported_conversion(comm, folder):
    """A conversion mapping with an operation on experts parameters that moe_ep cannot slice
    (a Transpose after the merge) is refused, naming the operation and the parameter."""
    import transformers.conversion_mapping as cm
    from transformers.core_model_loading import Transpose, WeightConverter

    from moe_ep import UnsupportedError
    import moe_ep.transformers as mt

    original = cm.get_model_conversion_mapping

    def with_transpose(model, *args, **kwargs):
        out = original(model, *args, **kwargs)
        for t in out:
            if isinstance(t, WeightConverter) and any("gate_proj" in p for p in t.source_patterns):
                t.operations = list(t.operations) + [Transpose(dim0=1, dim1=2)]
        return out

    cm.get_model_conversion_mapping = with_transpose
    try:
        _expect(UnsupportedError,
                lambda: mt.from_pretrained(os.path.join(folder, QWEN3), comm),
                "Transpose", "model.layers.0.mlp.experts.gate_up_proj")
    finally:
        cm.get_model_conversion_mapping = original


CASES = {
    "load_qwen3": case_load_qwen3,
    "load_gpt_oss": case_load_gpt_oss,
    "load_tied_sharded_bf16": case_load_tied_sharded_bf16,
    "missing_expert": case_missing_expert,
    "different_checkpoints": case_different_checkpoints,
    "world_size_not_dividing": case_world_size_not_dividing,
    "missing_files": case_missing_files,
    "missing_folder_on_one_rank": case_missing_folder_on_one_rank,
    "unsupported_conversion": case_unsupported_conversion,
}


def main(argv) -> int:
    from mpi4py import MPI
    import torch

    from mpi_report import say

    comm = MPI.COMM_WORLD
    torch.set_num_threads(1)
    folder, names = argv[0], list(argv[1:]) or list(CASES)
    failed = 0
    for name in names:
        t0 = time.perf_counter()
        try:
            CASES[name](comm, folder)
            say(f"CASE {name} rank={comm.Get_rank()} OK ({time.perf_counter() - t0:.2f} s)")
        except Exception as err:  # report and go on: the other ranks made the same calls
            failed += 1
            why = f"{type(err).__name__}: {err}".replace("\n", " | ")
            say(f"CASE {name} rank={comm.Get_rank()} FAIL: {why}")
            traceback.print_exc()
    say(f"DONE rank={comm.Get_rank()} failed={failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


# ------------------------------------------------------------------------------------------
# The tests (pytest)

import pytest  # noqa: E402

from needs import missing  # noqa: E402
from test_dispatch_mpi import _mpirun, _tail  # noqa: E402  (mpirun and mpi4py, or skipped)

if importlib.util.find_spec("transformers") is None:
    missing("transformers is not installed (pip install .[transformers])")

# (world size, cases): every case at W 2; the qwen3-moe load at W 4 too.
LAUNCHES = {2: list(CASES), 4: ["load_qwen3", "missing_expert"]}


def _make(out: Path, *args: str) -> None:
    from moe_ep.transformers.make_checkpoint import main as make

    assert make(["--small", "--dtype", "fp32", "--out", str(out), *args]) == 0


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    """The checkpoints the cases read, written once."""
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("hf-loader")
    _make(root / QWEN3, "--model", "qwen3-moe")
    _make(root / QWEN3_SEED1, "--model", "qwen3-moe", "--seed", "1")
    _make(root / GPT_OSS, "--model", "gpt-oss")
    _make(root / TIED_SHARDED, "--model", "qwen3-moe", "--tie-embeddings", "--dtype", "bf16",
          "--max-shard-size", "200KB")
    _make(root / EXPERTS3, "--model", "qwen3-moe", "--experts", "3")
    shutil.copytree(root / QWEN3, root / MISSING_EXPERT)
    tensors = load_file(str(root / MISSING_EXPERT / "model.safetensors"))
    del tensors[DROPPED]
    save_file(tensors, str(root / MISSING_EXPERT / "model.safetensors"), metadata={"format": "pt"})
    (root / NO_WEIGHTS).mkdir()
    shutil.copy(root / QWEN3 / "config.json", root / NO_WEIGHTS / "config.json")
    return str(root)


@functools.lru_cache(maxsize=None)
def _launch(world: int, folder: str):
    proc = _mpirun(world, str(Path(__file__).resolve()), folder, *LAUNCHES[world])
    results: dict = {}
    for m in re.finditer(r"^CASE (\S+) rank=(\d+) (OK|FAIL: .*?)(?: \([\d.]+ s\))?$",
                         proc.report, re.M):
        results.setdefault(m.group(1), {})[int(m.group(2))] = m.group(3)
    return proc, results


@pytest.mark.parametrize("world", sorted(LAUNCHES))
def test_launch_completes(world, folder):
    """Every rank reached the end (no hang after the bad inputs), and the launch exited 0."""
    proc, _ = _launch(world, folder)
    done = re.findall(r"^DONE rank=(\d+) failed=(\d+)$", proc.report, re.M)
    assert sorted(int(r) for r, _ in done) == list(range(world)), _tail(proc.stdout + proc.stderr)
    assert proc.returncode == 0, _tail(proc.stdout + proc.stderr)


@pytest.mark.parametrize("world,name", [(w, n) for w, names in sorted(LAUNCHES.items())
                                        for n in names])
def test_case(world, name, folder):
    proc, results = _launch(world, folder)
    got = results.get(name, {})
    lacking = [r for r in range(world) if r not in got]
    assert not lacking, f"no report from rank(s) {lacking}:\n{_tail(proc.stdout + proc.stderr)}"
    failed = {r: v for r, v in sorted(got.items()) if v != "OK"}
    assert not failed, "\n".join(f"rank {r}: {v}" for r, v in failed.items())


def test_checkpoint_layout_and_sizes(folder):
    """save_pretrained wrote qwen3-moe's experts per expert (legacy keys) and gpt-oss's fused;
    moe_ep_sizes.json's bytes add up to the tensors in the file, split at the experts."""
    from safetensors import safe_open

    for name, expert_key in ((QWEN3, "model.layers.0.mlp.experts.7.gate_proj.weight"),
                             (GPT_OSS, "model.layers.0.mlp.experts.gate_up_proj")):
        sizes = json.loads(Path(folder, name, "moe_ep_sizes.json").read_text())
        total = expert = 0
        with safe_open(os.path.join(folder, name, "model.safetensors"), "pt") as f:
            keys = list(f.keys())
            for k in keys:
                t = f.get_slice(k)
                n = 4
                for d in t.get_shape():
                    n *= d
                total += n
                if ".experts." in k:
                    expert += n
        assert expert_key in keys, (name, [k for k in keys if "experts" in k][:4])
        assert sizes["expert_bytes"] == expert and sizes["non_expert_bytes"] == total - expert, \
            (name, sizes, expert, total)
        assert sizes["num_experts"] == 8 and sizes["layers"] == 2


def test_real_widths_by_default():
    """Without overrides the configs have the real models' widths."""
    from moe_ep.transformers.make_checkpoint import build_config

    q = build_config("qwen3-moe", 2)
    assert (q.hidden_size, q.num_local_experts, q.num_experts_per_tok, q.moe_intermediate_size,
            q.num_attention_heads, q.num_key_value_heads, q.head_dim, q.vocab_size) == \
        (2048, 128, 8, 768, 32, 4, 128, 151936)
    m = build_config("mixtral", 2)
    assert (m.hidden_size, m.num_local_experts, m.num_experts_per_tok, m.intermediate_size) == \
        (4096, 8, 2, 14336)
    o = build_config("olmoe", 2)
    assert (o.hidden_size, o.num_experts, o.num_experts_per_tok, o.intermediate_size) == \
        (2048, 64, 8, 1024)
    g = build_config("gpt-oss", 3)
    assert (g.hidden_size, g.num_local_experts, g.num_experts_per_tok, g.vocab_size) == \
        (2880, 32, 4, 201088)
    assert g.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    for layers, dense in ((1, 0), (2, 1), (3, 2), (8, 3)):
        d = build_config("deepseek-v3", layers)
        assert (d.hidden_size, d.n_routed_experts, d.num_experts_per_tok, d.n_shared_experts,
                d.kv_lora_rank) == (7168, 256, 8, 1, 512)
        assert d.first_k_dense_replace == dense  # at least one MoE layer


def test_fingerprint_tells_seeds_apart(folder):
    """Same widths, other seed: same headers and sizes, different hash (sampled data)."""
    from moe_ep.transformers._loader import open_checkpoint

    a = open_checkpoint(os.path.join(folder, QWEN3))
    b = open_checkpoint(os.path.join(folder, QWEN3_SEED1))
    assert a.fingerprint != b.fingerprint
    assert a.fingerprint == open_checkpoint(os.path.join(folder, QWEN3)).fingerprint
    assert {k: (e.shape, e.dtype) for k, e in a.entries.items()} == \
        {k: (e.shape, e.dtype) for k, e in b.entries.items()}
