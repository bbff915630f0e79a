#!/usr/bin/env python3
"""ctest's part of "every README code block runs as written" (tests/readme/readme_blocks.py says
how each block is run; python/tests/test_readme.py runs the Python ones in the venv).

  readme_test.py blocks                       every block has a runner or a skip marker
  readme_test.py shell --build B --work D     the ctest shell blocks and inline commands
  readme_test.py cpp --build B --work D       each cpp block built with each cmake block against
                                              `cmake --install B`, then run as it says
  readme_test.py selftest --work D            the extractor and runners catch what they must

Exit status 0 when everything passed; otherwise 1, with each failing block's output.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import readme_blocks as rb  # noqa: E402

SHELL_TIMEOUT_S = 240
BUILD_TIMEOUT_S = 300
RUN_TIMEOUT_S = 120


def cmd_blocks(args) -> bool:
    blocks = rb.load(args.readme)  # raises ReadmeError on an unmarked block without a runner
    print(rb.plan(blocks))
    runners = {b.runner() for b in blocks}
    # The README has blocks of each runner; finding none means the parser broke.
    return {"ctest", "pytest"} <= runners


def cmd_shell(args) -> bool:
    blocks = [b for b in rb.load(args.readme) if b.kind in ("shell", "inline")]
    work = fresh(args.work)
    root = rb.repo_view(work, args.build)
    env = rb.user_env()
    results = [rb.run_shell(b, root, env, SHELL_TIMEOUT_S) for b in blocks]
    ok = rb.report(results)
    print(f"readme shell: {len(results)} blocks and inline commands, "
          f"{sum(not r.ok for r in results)} failed")
    return ok and bool(results)


def cmd_cpp(args) -> bool:
    blocks = rb.load(args.readme)
    cpps = [b for b in blocks if b.kind == "cpp"]
    cmakes = [b for b in blocks if b.kind == "cmake"]
    if bool(cpps) != bool(cmakes):
        raise rb.ReadmeError("a cpp block is built with each cmake block and the other way "
                             f"round, but the README has {len(cpps)} cpp and {len(cmakes)} "
                             "cmake blocks")
    work = fresh(args.work)
    prefix = work / "prefix"
    env = rb.user_env()
    install = subprocess.run(["cmake", "--install", str(args.build), "--prefix", str(prefix)],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if install.returncode != 0:
        print(install.stdout)
        print(f"readme cpp: cmake --install {args.build} failed")
        return False
    results = []
    for j, cm in enumerate(cmakes):
        exe = re.search(r"add_executable\(\s*(\S+)\s+([^)\s]+)", cm.text)
        if not exe:
            raise rb.ReadmeError(f"{cm.where()}: a cmake block builds the cpp blocks: it needs "
                                 "add_executable(<name> <source>)")
        for i, cpp in enumerate(cpps):
            app = work / f"app{j}_{i}"
            app.mkdir()
            (app / "CMakeLists.txt").write_text(cm.text)
            (app / exe.group(2)).write_text(cpp.text)
            run = rb.run_command_comment(cpp, "//")
            steps = [
                (cm, ["cmake", "-S", str(app), "-B", str(app / "build"),
                      f"-DCMAKE_PREFIX_PATH={prefix}", "-DCMAKE_BUILD_TYPE=Release",
                      # The README's program compiles without a warning, except GCC's about
                      # fields a designated initializer leaves to their defaults (the API's
                      # input structs are meant to be filled that way).
                      "-DCMAKE_CXX_FLAGS=-Wall -Wextra -Wno-missing-field-initializers -Werror"],
                 BUILD_TIMEOUT_S, None),
                (cpp, ["cmake", "--build", str(app / "build")], BUILD_TIMEOUT_S, None),
                (cpp, ["bash", "-c", run], RUN_TIMEOUT_S, r"^PASS$"),
            ]
            for block, argv, timeout, must_print in steps:
                r = rb.run_command(block, argv, app, env, timeout, must_print)
                results.append(r)
                if not r.ok:
                    break
    ok = rb.report(results)
    print(f"readme cpp: {len(cpps)} cpp x {len(cmakes)} cmake blocks, "
          f"{sum(not r.ok for r in results)} steps failed")
    return ok and bool(results)


def cmd_selftest(args) -> bool:
    """The convention is enforced and a failing block fails: on small made-up READMEs."""
    failures = []

    def expect_error(text, needle):
        try:
            rb.parse(text)
        except rb.ReadmeError as e:
            if needle not in str(e):
                failures.append(f"error {str(e)!r} lacks {needle!r}")
            return
        failures.append(f"no error for {text!r} (wanted {needle!r})")

    expect_error("x\n```rust\nfn main() {}\n```\n", "no runner for a ```rust block")
    expect_error("<!-- readme-test: skip: -->\n```rust\n```\n", "needs a reason")
    expect_error("<!-- readme-test: skip: why -->\n\n```rust\n```\n", "not on the line just")
    expect_error("<!-- readme-test: skip: why -->", "not followed by a fence")
    expect_error("<!-- readme-test: run -->\n```\nls\n```\n", "unknown readme-test marker")
    expect_error("```\nls\n", "never closed")

    blocks = rb.parse("a `build/bin/moe-ep run --help` b\n"
                      "<!-- readme-test: skip: why -->\n```rust\n```\n"
                      "~~~python\nprint(1)\n~~~\n```\npython x.py  # venv\n```\n"
                      "```bash\nls  # python in a comment only\n```\n"
                      "| `--mask a\\|b` | `build/bin/moe-ep run --mask none\\|prefix` |\n")
    got = [(b.line, b.kind) for b in blocks]
    want = [(1, "inline"), (3, "skip"), (5, "python"), (8, "venv-shell"), (11, "shell"),
            (14, "inline")]
    if got != want:
        failures.append(f"parse: {got} != {want}")
    elif blocks[-1].text != "build/bin/moe-ep run --mask none|prefix\n":
        failures.append(f"table cell pipe: {blocks[-1].text!r}")

    work = fresh(args.work)
    env = rb.user_env()
    good, bad = rb.parse("```\ntrue\necho PASS\n```\n```\ntrue\nfalse\necho after\n```\n")
    if not rb.run_shell(good, work, env, 30).ok:
        failures.append("a passing shell block failed")
    r = rb.run_shell(bad, work, env, 30)
    if r.ok or "after" in r.output.replace("echo after", ""):
        failures.append(f"a failing line did not fail the block: {r.output!r}")
    r = rb.run_command(good, ["echo", "nothing"], work, env, 30, r"^PASS$")
    if r.ok:
        failures.append("a program that prints no PASS line passed")
    cpp = rb.parse("```cpp\n// build it; run it: mpirun -n 2 build/my_app\nint main() {}\n```\n")
    if rb.run_command_comment(cpp[0], "//") != "mpirun -n 2 build/my_app":
        failures.append("the cpp block's run command was not found")
    if "OMPI_MCA_rmaps_base_oversubscribe" in rb.user_env():
        failures.append("user_env keeps OMPI_MCA_rmaps_base_oversubscribe")

    for f in failures:
        print("selftest:", f)
    print(f"readme selftest: {len(failures)} failed")
    return not failures


def fresh(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["blocks", "shell", "cpp", "selftest"])
    ap.add_argument("--readme", type=Path, default=rb.README)
    ap.add_argument("--build", type=Path, help="the build tree under test")
    ap.add_argument("--work", type=Path, help="a scratch directory (emptied first)")
    args = ap.parse_args()
    if args.what in ("shell", "cpp") and not args.build:
        ap.error("--build is required")
    if args.what != "blocks" and not args.work:
        ap.error("--work is required")
    try:
        ok = {"blocks": cmd_blocks, "shell": cmd_shell, "cpp": cmd_cpp,
              "selftest": cmd_selftest}[args.what](args)
    except rb.ReadmeError as e:
        print(f"README.md breaks the readme-test convention (tests/readme/readme_blocks.py):\n{e}")
        return 1
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
