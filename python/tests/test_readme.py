"""The README's Python code runs as written (the venv's half of "every README code block runs":
tests/readme/readme_blocks.py says how each block is run; ctest's readme.* tests run the rest).

- every python block: saved under the file name its comments give and run by the command they
  give (`mpirun -n 4 --oversubscribe python moe_step.py`), with this venv's python first on PATH;
  it must exit 0 and print PASS (one line per rank under mpirun);
- every shell block that runs python, pip or torchrun: run from the repository root (build/ is
  the repository's), as one bash script, with this venv first on PATH, as after
  `. .venv/bin/activate`.

The environment is the README user's (readme_blocks.user_env): mpirun gets no implicit
--oversubscribe.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "readme"))
import readme_blocks as rb  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import needs  # noqa: E402

TIMEOUT_S = 240
BLOCKS = rb.load()  # a block without a runner or a skip marker fails the collection here
VENV_BIN = str(Path(sys.executable).parent)

needs.mpirun()  # skipped without mpirun or mpi4py; failed under CI (CI=true)


def _ids(blocks):
    return [f"README.md:{b.line}" for b in blocks]


PYTHON_BLOCKS = [b for b in BLOCKS if b.kind == "python"]
VENV_SHELL_BLOCKS = [b for b in BLOCKS if b.kind == "venv-shell"]


def _env():
    env = rb.user_env(extra_path=[VENV_BIN])
    env["VIRTUAL_ENV"] = str(Path(VENV_BIN).parent)
    env.setdefault("MOE_EP_TIMEOUT_S", "60")  # a hang fails within a minute
    return env


def _check(result):
    assert result.ok, f"{result.block.where()}: {result.command}\n{result.output[-8000:]}"


def test_readme_has_python_blocks():
    assert PYTHON_BLOCKS and VENV_SHELL_BLOCKS, rb.plan(BLOCKS)


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=_ids(PYTHON_BLOCKS))
def test_python_block(block, tmp_path):
    command = rb.run_command_comment(block, "#")
    script = re.search(r"\bpython3?\s+(\S+\.py)\b", command)
    assert script, f"{block.where()}: the run command {command!r} names no NAME.py"
    (tmp_path / script.group(1)).write_text(block.text)
    result = rb.run_command(block, ["bash", "-c", command], tmp_path, _env(), TIMEOUT_S)
    _check(result)
    ranks = re.search(r"\bmpirun\s.*?-(?:n|np)\s+(\d+)", command)
    passes = re.findall(r"PASS", result.output)  # not per line: the ranks' lines may interleave
    assert len(passes) == (int(ranks.group(1)) if ranks else 1), result.output[-8000:]


@pytest.mark.parametrize("block", VENV_SHELL_BLOCKS, ids=_ids(VENV_SHELL_BLOCKS))
def test_venv_shell_block(block, tmp_path):
    root = rb.repo_view(tmp_path, None)
    _check(rb.run_shell(block, root, _env(), TIMEOUT_S))
