"""Every SPEC citation in the repository resolves to a heading of docs/spec.md.

Code, messages and docs cite the SPEC by section ("SPEC" and a section sign followed by 1.4, or
"SPEC 2.3"); docs/spec.md is the SPEC, with "## N." and "### N.M " headings. A citation of a
section it lacks sends the reader nowhere, so this test lists each one as file:line. It reads the
tracked files (git ls-files) as plain text: no torch, no built extension. Without the suite's
conftest (which imports torch): `python3 -m pytest --noconftest python/tests/test_spec_refs.py`,
or `python3 python/tests/test_spec_refs.py`.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "docs" / "spec.md"
SECTION = "\u00a7"  # written as an escape so that this file cites nothing itself

NUMBER = r"\d+(?:\.\d+)*"
# A section sign and a number, or a range of two ("1-2", "2.2-2.3": both ends must resolve).
CITE_SIGN = re.compile(SECTION + r"\s*(" + NUMBER + r")(?:[-\u2013](" + NUMBER + r"))?")
# "SPEC 2.3" without the sign (a dotted number, so that "SPEC 2 ranks" is not a citation).
CITE_WORD = re.compile(r"\bSPEC\s+(\d+\.\d+(?:\.\d+)*)\b")
HEADING = re.compile(r"^(?:## (\d+)\.\s|### (\d+\.\d+)\s)")
# The SPEC used to live outside the repository, where a clone cannot follow it.
OUTSIDE = re.compile(r"shared/SPEC|SPEC\.md|\.\./shared/|shared/seeds")


def spec_sections() -> set[str]:
    found = set()
    for line in SPEC.read_text(encoding="utf-8").splitlines():
        m = HEADING.match(line)
        if m:
            found.add(m.group(1) or m.group(2))
    return found


def tracked_texts():
    """(path relative to the root, text) of each tracked file that exists and is text."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the tracked files are unknown")
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True, capture_output=True).stdout
    for rel in sorted(p for p in out.decode("utf-8", "surrogateescape").split("\0") if p):
        path = ROOT / rel
        if not path.is_file():  # deleted in the working tree, not yet committed
            continue
        data = path.read_bytes()
        if b"\0" in data:
            continue
        yield rel, data.decode("utf-8", "replace")


def citations(text: str):
    """(line number, cited section) for each citation in text."""
    for number, line in enumerate(text.splitlines(), 1):
        for m in CITE_SIGN.finditer(line):
            yield number, m.group(1)
            if m.group(2):
                yield number, m.group(2)
        for m in CITE_WORD.finditer(line):
            yield number, m.group(1)


def unresolved(sections: set[str], files) -> list[str]:
    return [f"{rel}:{number}: {SECTION}{cited}"
            for rel, text in files
            for number, cited in citations(text)
            if cited not in sections]


def test_spec_has_its_sections():
    sections = spec_sections()
    # The chapters every part of the project cites; a heading format the parser misses shows here.
    assert {"1", "1.4", "2", "2.3", "3", "4", "4.3", "5", "6", "7"} <= sections, sorted(sections)


def test_every_spec_citation_resolves():
    sections = spec_sections()
    files = list(tracked_texts())
    count = sum(1 for _, text in files for _ in citations(text))
    assert count > 0, "no citation found: the pattern no longer matches the project's citations"
    bad = unresolved(sections, files)
    assert not bad, (f"{len(bad)} of {count} SPEC citations name no heading of docs/spec.md "
                     f"(its sections: {', '.join(sorted(sections, key=_key))}):\n  "
                     + "\n  ".join(bad))


def test_no_file_points_outside_the_repository_for_the_spec():
    me = Path(__file__).resolve().relative_to(ROOT).as_posix()
    bad = [f"{rel}:{number}: {line.strip()}"
           for rel, text in tracked_texts() if rel != me
           for number, line in enumerate(text.splitlines(), 1) if OUTSIDE.search(line)]
    assert not bad, "the SPEC is docs/spec.md; these lines point elsewhere:\n  " + "\n  ".join(bad)


def test_the_parser_catches_a_missing_section():
    # The check itself: a citation of a section docs/spec.md lacks is reported with file:line.
    text = "ok " + SECTION + "1.4\nbad " + SECTION + "1.4-9.9, SPEC" + " 8.1 and " + SECTION + "2.3\n"
    assert unresolved({"1.4", "2.3"}, [("x.md", text)]) == [
        "x.md:2: " + SECTION + "9.9", "x.md:2: " + SECTION + "8.1"]


def _key(section: str):
    return [int(part) for part in section.split(".")]


if __name__ == "__main__":
    import sys
    sys.exit(pytest.main(["-q", "--noconftest", "-p", "no:cacheprovider", __file__]))
