"""Every code block of README.md runs as written: the extractor and the runners (standard library
only; ctest runs it through tests/readme/readme_test.py, pytest through
python/tests/test_readme.py).

A block is a fenced code block (``` or ~~~). Its kind, and so who runs it, follows from its info
string, unless a marker on the line just before the fence says otherwise:

    <!-- readme-test: skip: <why it cannot run inside the tests> -->

  cpp, c++, cc    a complete program; written to the source file each cmake block's
                  add_executable() names, built with that block as its CMakeLists.txt against the
                  installed package (cmake --install of the build tree), then run by the command
                  in its comments (`mpirun ...`, from the project's directory): ctest readme.cpp.
  cmake           a consumer's complete CMakeLists.txt, built with each cpp block (above).
  python          a script; its comments say the file name and how it is run (`mpirun ...
                  python NAME.py` or `python NAME.py`): written to NAME.py and run that way with
                  the venv's python first on PATH: pytest python/tests/test_readme.py.
  (none), sh, bash, shell, console
                  shell commands, run as one bash script (`set -e -x`: the first failing line fails
                  the block) from the repository's root, where build/ is the build tree under test.
                  A block that runs python, pip or torchrun needs the venv: pytest runs it with
                  the venv first on PATH; every other shell block: ctest readme.shell.
  anything else   no runner: an error until the block gets a runner here or a skip marker.

Inline code spans outside the blocks that contain `build/bin/moe-ep` are commands too (the flags
table's examples): ctest readme.shell runs each.

A block that neither has a runner nor a skip marker, a marker without a reason, a marker that
does not stand just before a fence, or an unknown marker fails every readme test: a new block is
never silently untested.

The environment is the user's as the README describes it: what scripts/setup.sh sets (as root,
OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1), and never a default that would hide
a missing `--oversubscribe` (ctest's OMPI_MCA_rmaps_base_oversubscribe is removed).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"

CPP_LANGS = {"cpp", "c++", "cc", "cxx"}
SHELL_LANGS = {"", "sh", "bash", "shell", "console"}
# A shell block that uses one of these programs needs the Python venv (pytest runs it).
VENV_PROGRAMS = re.compile(r"(?<![\w./-])(python3?|pip3?|torchrun)(?![\w-])")
MARKER = re.compile(r"^\s*<!--\s*readme-test:\s*(.*?)\s*-->\s*$")
FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`]*?)\s*$")
INLINE_COMMAND = "build/bin/moe-ep"


class ReadmeError(Exception):
    """The README breaks the block convention (see the module docstring)."""


@dataclasses.dataclass
class Block:
    line: int  # 1-based line of the opening fence (for an inline command: its line)
    lang: str  # the info string's first word, lower case ("" for none); "inline" for a span
    text: str  # the block's content, ending with a newline
    kind: str = ""  # cpp, cmake, python, shell, venv-shell, inline, skip
    skip_reason: str = ""

    def where(self) -> str:
        if self.kind == "inline":
            return f"README.md:{self.line} (inline command)"
        return f"README.md:{self.line} ({self.lang or 'plain'} block)"

    def runner(self) -> str:
        """Which test runs it: ctest, pytest or nobody (a skip marker)."""
        if self.kind == "skip":
            return "skipped"
        return "pytest" if self.kind in ("python", "venv-shell") else "ctest"


def parse(text: str) -> List[Block]:
    """The fenced blocks and inline commands of a README, each classified. Raises ReadmeError."""
    lines = text.split("\n")
    blocks: List[Block] = []
    errors: List[str] = []
    pending: Optional[tuple] = None  # (line, directive) of a marker waiting for its fence
    i = 0
    while i < len(lines):
        line = lines[i]
        m = FENCE.match(line)
        if m:
            fence, lang = m.group("fence"), (m.group("info").split() or [""])[0].lower()
            start = i + 1
            body: List[str] = []
            i += 1
            while i < len(lines):
                close = lines[i].strip()
                if close and set(close) == {fence[0]} and len(close) >= len(fence):
                    break
                body.append(lines[i])
                i += 1
            else:
                errors.append(f"README.md:{start}: the fence opened here is never closed")
            block = Block(line=start, lang=lang, text="\n".join(body) + "\n")
            marker = pending if pending and pending[0] == start - 1 else None
            pending = None
            _classify(block, marker, errors)
            blocks.append(block)
            i += 1
            continue
        mm = MARKER.match(line)
        if mm:
            if pending:
                errors.append(f"README.md:{pending[0]}: readme-test marker not followed by a fence")
            pending = (i + 1, mm.group(1))
            i += 1
            continue
        if pending:
            errors.append(f"README.md:{pending[0]}: readme-test marker not on the line just "
                          "before a fence")
            pending = None
        for span in re.findall(r"`([^`]+)`", line):
            if INLINE_COMMAND in span:
                if line.lstrip().startswith("|"):
                    span = span.replace("\\|", "|")  # a table cell's escaped pipe
                blocks.append(Block(line=i + 1, lang="inline", text=span + "\n", kind="inline"))
        i += 1
    if pending:
        errors.append(f"README.md:{pending[0]}: readme-test marker not followed by a fence")
    if errors:
        raise ReadmeError("\n".join(errors))
    return blocks


def _classify(block: Block, marker: Optional[tuple], errors: List[str]) -> None:
    if marker:
        m = re.fullmatch(r"skip:\s*(.*)", marker[1])
        if not m:
            errors.append(f"README.md:{marker[0]}: unknown readme-test marker {marker[1]!r} "
                          "(the one marker is 'skip: <reason>')")
        elif not m.group(1):
            errors.append(f"README.md:{marker[0]}: a skip marker needs a reason: "
                          "<!-- readme-test: skip: <reason> -->")
        block.kind, block.skip_reason = "skip", m.group(1) if m else ""
    elif block.lang in CPP_LANGS:
        block.kind = "cpp"
    elif block.lang == "cmake":
        block.kind = "cmake"
    elif block.lang == "python":
        block.kind = "python"
    elif block.lang in SHELL_LANGS:
        code = "\n".join(l.split("#", 1)[0] for l in block.text.splitlines())
        block.kind = "venv-shell" if VENV_PROGRAMS.search(code) else "shell"
    else:
        errors.append(f"{block.where()}: no runner for a ```{block.lang} block; give it one in "
                      "tests/readme/readme_blocks.py or put "
                      "<!-- readme-test: skip: <reason> --> on the line before its fence")


def load(readme: Path = README) -> List[Block]:
    return parse(readme.read_text(encoding="utf-8"))


def plan(blocks: Sequence[Block]) -> str:
    """One line per block: where it is, its kind and who runs it (or why nobody does)."""
    out = []
    for b in blocks:
        first = b.text.strip().splitlines()[0] if b.text.strip() else ""
        what = f"skipped: {b.skip_reason}" if b.kind == "skip" else f"{b.kind} -> {b.runner()}"
        out.append(f"{b.where():42} {what:30.200} | {first[:70]}")
    return "\n".join(out)


# ---- running ----------------------------------------------------------------------------------


def user_env(extra_path: Sequence[str] = ()) -> Dict[str, str]:
    """The environment a user following the README has: ours, plus what scripts/setup.sh's
    moe_ep_mpi_env exports, minus anything that makes mpirun oversubscribe without being asked
    (the README's commands must say --oversubscribe where they need it)."""
    env = {k: v for k, v in os.environ.items()
           if "OVERSUBSCRIBE" not in k.upper() and "oversubscribe" not in v.lower()}
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    if extra_path:
        env["PATH"] = os.pathsep.join([*extra_path, env.get("PATH", "")])
    return env


def repo_view(work: Path, build_dir: Optional[Path]) -> Path:
    """work/root: the repository's top-level entries as symbolic links, with build/ the build
    tree under test, so that the README's commands run 'from the repository root' while what
    they write (batch.safetensors, ...) stays in work/."""
    root = work / "root"
    root.mkdir(parents=True, exist_ok=True)
    for entry in REPO.iterdir():
        if entry.name in (".git", "build"):
            continue
        link = root / entry.name
        if not link.is_symlink():
            link.symlink_to(entry)
    build_link = root / "build"
    if build_link.is_symlink():
        build_link.unlink()
    target = build_dir if build_dir is not None else REPO / "build"
    build_link.symlink_to(Path(target).resolve())
    return root


@dataclasses.dataclass
class Result:
    block: Block
    ok: bool
    seconds: float
    output: str
    command: str


def run_command(block: Block, argv: List[str], cwd: Path, env: Dict[str, str], timeout: float,
                must_print: Optional[str] = None, shown: Optional[str] = None) -> Result:
    t0 = time.monotonic()
    try:
        p = subprocess.run(argv, cwd=cwd, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, timeout=timeout)
        ok, output = p.returncode == 0, p.stdout
        if not ok:
            output += f"\n[exit status {p.returncode}]"
    except subprocess.TimeoutExpired as e:
        ok = False
        output = (e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes)
                  else e.stdout or "") + f"\n[did not finish in {timeout} s]"
    if ok and must_print is not None and not re.search(must_print, output, re.M):
        ok = False
        output += f"\n[exit status 0, but the output has no line matching {must_print!r}]"
    return Result(block, ok, time.monotonic() - t0, output, shown or shlex.join(argv))


def run_shell(block: Block, cwd: Path, env: Dict[str, str], timeout: float) -> Result:
    """The block as one bash script: every line runs, the first failing one ends it (set -e),
    each is echoed to the output before it runs (set -x)."""
    script = "set -e -o pipefail -x\n" + block.text
    shown = f"bash -c 'set -e -o pipefail -x; <the block>' in {cwd}"
    return run_command(block, ["bash", "-c", script], cwd, env, timeout, shown=shown)


def run_command_comment(block: Block, comment: str) -> str:
    """The run command a cpp/python block names in its comments: the text from `mpirun` (or,
    for python, `python`) to the end of that comment line."""
    starts = ["mpirun "] + (["python ", "python3 "] if block.kind == "python" else [])
    for line in block.text.splitlines():
        s = line.strip()
        if not s.startswith(comment):
            continue
        body = s[len(comment):]
        for start in starts:
            k = body.find(start)
            if k >= 0 and (k == 0 or not body[k - 1].isalnum()):
                return body[k:].strip()
    raise ReadmeError(f"{block.where()}: no run command in its comments: a {block.lang} block "
                      f"names how it runs, e.g. `{comment} run: mpirun -n 2 ...`")


def report(results: Sequence[Result], stream=sys.stdout, tail: int = 6000) -> bool:
    ok = True
    for r in results:
        status = "ok" if r.ok else "FAILED"
        print(f"--- {r.block.where()}: {status} ({r.seconds:.1f} s): {r.command[:300]}", file=stream)
        out = r.output if r.ok or len(r.output) <= tail else "..." + r.output[-tail:]
        if not r.ok or os.environ.get("MOE_EP_README_VERBOSE"):
            print(out, file=stream)
        else:  # the last lines: what the block printed at the end (PASS, ...)
            print("\n".join(out.rstrip().splitlines()[-3:]), file=stream)
        ok &= r.ok
    return ok
