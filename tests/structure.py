#!/usr/bin/env python3
"""Checks of the source tree's structure that the compiler does not make.

  structure.py layering ROOT   every #include "..." goes downward (or sideways within a layer)
  structure.py length ROOT     no function in src/ longer than MAX_LINES lines, SIMD kernel
                               bodies (the Highway sources listed below) excepted
  structure.py selftest        plants one offence of each kind in a scratch tree and checks
                               that each is reported (and that comments and strings are not)

Layers, top to bottom: include/moe_ep (the API) -> src/core and src/sharding (plans, the ops as
named steps) -> src/kernels (leaves: they know no network) and src/transport (moves opaque
bytes) -> src/base (checks, threads, environment, the tensor view). The transport's interface is
the headers directly in src/transport (bytes, offsets, tags, deadlines); its implementations are
src/transport/mpi and src/transport/shm. src/core and src/sharding include only the interface,
never <mpi.h>, and name no MPI type or function; nor does the interface. ref/ (the test oracles)
shares no code with what it checks; tools/, python/src/ and examples/ use the public API only.
The ops' steps and call state (dispatch.cc, combine.cc and their *_call.h) know routes only
through DispatchRoute / CombineRoute: the nodes of comm_alg "hierarchy" (core/ep/route.h) are the
relay routes' own. Their steps take and return typed values: only the steps that make the
outputs (and the sequencing ones) take the call (Dispatch, Combine) as a mutable reference;
every other takes it const. Exits 1 naming every offence.
"""
import pathlib
import re
import sys

# Directory -> the top-level include prefixes it may use ("local": a header beside the file).
ALLOWED = {
    "include/moe_ep": {"moe_ep"},
    "src/base": {"base", "moe_ep"},
    "src/kernels": {"base", "kernels", "moe_ep"},
    "src/transport": {"base", "transport", "moe_ep"},
    "src/core": {"base", "kernels", "transport", "core", "moe_ep"},
    "src/sharding": {"base", "kernels", "transport", "core", "sharding", "moe_ep"},
    "ref": {"ref", "moe_ep"},
    "tools": {"moe_ep", "local"},
    "python/src": {"moe_ep", "local"},
    "examples": {"moe_ep", "local"},
    "bench": {"moe_ep", "ref", "local"},
}
# Public types every layer uses, and the one directory their member functions may be defined in:
# the bottom layer, so that no leaf (kernels, transport) depends on core at link time.
HOMES = {"Tensor": "src/base", "TensorView": "src/base"}
DEFINITION = re.compile(r"^[\w:<>*&][\w:<>*&\s]*?\b(" + "|".join(HOMES) + r")::~?\w+\s*\(")
# Sources whose functions are SIMD kernel bodies (Highway's per-target code), allowed to be long.
KERNEL_BODIES = {"src/kernels/cpu/convert.cc", "src/kernels/cpu/quant.cc",
                 "src/kernels/cpu/rows-inl.h"}
MAX_LINES = 150
SOURCES = ("*.cc", "*.h")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"')
# The layers that see the transport only through its interface, and what they may not name.
TRANSPORT_USERS = ("src/core", "src/sharding")
CONCRETE_TRANSPORTS = ("transport/mpi/", "transport/shm/")
MPI_HEADER = re.compile(r"^\s*#\s*include\s+<mpi\.h>")
MPI_NAME = re.compile(r"\bMPI_\w+")
# The ops' steps and call state, and what only the relay routes may name.
ROUTE_USERS = ("src/core/ep/dispatch.cc", "src/core/ep/combine.cc", "src/core/ep/dispatch_call.h",
               "src/core/ep/combine_call.h")
ROUTE_HEADER = "core/ep/route.h"
RELAY_NAME = re.compile(r"\b(Nodes|relayed|relay_on|relay_of)\b")
# The functions that may take the call state mutably, per file: the outputs and the memory they
# live in (validation, allocation, the agreements that place a slot, the send buffer, the end),
# and the sequencing of the steps. Every other function of these files takes it const.
MUTABLE_CALL = {
    "src/core/ep/dispatch.cc": {"check_arguments", "allocate_expand_x", "allocate_rows",
                                "allocate", "take_deferred_slot", "agree", "agree_on_sizes",
                                "allocate_send_buffer", "finish"},
    "src/core/ep/combine.cc": {"check_sum_inputs", "plan_from_tensors", "plan_from_handle",
                               "check_arguments", "allocate", "provide_rows", "agree",
                               "finish_reading", "abandon", "move_all_rows"},
    "src/core/ep/relay_dispatch.cc": set(),
    "src/core/ep/relay_combine.cc": set(),
    "src/core/ep/dispatch_call.h": set(),
    "src/core/ep/combine_call.h": set(),
}
# A function's name and parameter list, then its body or the end of its declaration.
SIGNATURE = re.compile(r"\b(\w+)\s*\(([^;{}]*?)\)\s*(?:const\s*)?(?:noexcept\s*)?"
                       r"(?:override\s*)?(?:final\s*)?(?:=\s*0\s*)?[{;:]")
CALL_PARAM = re.compile(r"\b(Dispatch|Combine)\s*[&*]")
KEYWORDS = {"if", "for", "while", "switch", "catch", "return", "sizeof"}


def files_under(root, d):
    base = root / d
    for pattern in SOURCES:
        yield from sorted(base.rglob(pattern))


def layering(root):
    bad = []
    for d, allowed in ALLOWED.items():
        for f in files_under(root, d):
            for n, line in enumerate(f.read_text().splitlines(), 1):
                m = INCLUDE.match(line)
                if not m:
                    continue
                target = m.group(1)
                top = target.split("/")[0] if "/" in target else "local"
                if top not in allowed:
                    bad.append(f"{f.relative_to(root)}:{n}: includes \"{target}\" "
                               f"({d} may include only {', '.join(sorted(allowed))})")
    bad += transport_seam(root)
    bad += route_seam(root)
    bad += call_state(root)
    for f in files_under(root, "src"):
        rel = f.relative_to(root).as_posix()
        for n, line in enumerate(f.read_text().splitlines(), 1):
            m = DEFINITION.match(line)
            if m and not rel.startswith(HOMES[m.group(1)] + "/"):
                bad.append(f"{rel}:{n}: defines a member of {m.group(1)}, which belongs in "
                           f"{HOMES[m.group(1)]} (every layer uses it)")
    return bad


def transport_seam(root):
    """src/core and src/sharding reach the transport through its interface only: no concrete
    transport's header, no <mpi.h>, no MPI name outside comments and strings. The interface (the
    headers directly in src/transport) names no MPI either."""
    bad = []
    interface = [f for f in files_under(root, "src/transport") if f.parent == root / "src/transport"]
    users = [f for d in TRANSPORT_USERS for f in files_under(root, d)]
    for f in users + interface:
        rel = f.relative_to(root).as_posix()
        text = f.read_text()
        for n, line in enumerate(text.splitlines(), 1):
            m = INCLUDE.match(line)
            if m and m.group(1).startswith(CONCRETE_TRANSPORTS):
                bad.append(f"{rel}:{n}: includes the concrete transport \"{m.group(1)}\" "
                           f"(use the interface: the headers directly in src/transport)")
            if MPI_HEADER.match(line):
                bad.append(f"{rel}:{n}: includes <mpi.h> (only src/transport/mpi and "
                           f"src/transport/shm may)")
        for n, line in enumerate(strip(text).splitlines(), 1):
            for m in MPI_NAME.finditer(line):
                bad.append(f"{rel}:{n}: names {m.group(0)} (MPI belongs behind the transport "
                           f"interface)")
    return bad


def route_seam(root):
    """The steps shared by both routes branch on no node: they ask their route (direct(d) and the
    route's calls), never include core/ep/route.h or name the nodes' helpers."""
    bad = []
    for rel in ROUTE_USERS:
        f = root / rel
        if not f.exists():
            continue
        text = f.read_text()
        for n, line in enumerate(text.splitlines(), 1):
            m = INCLUDE.match(line)
            if m and m.group(1) in (ROUTE_HEADER, ROUTE_HEADER.split("/")[-1]):
                bad.append(f"{rel}:{n}: includes \"{ROUTE_HEADER}\" (the nodes are the relay "
                           f"routes' own: relay_*.cc)")
        for n, line in enumerate(strip(text).splitlines(), 1):
            for m in RELAY_NAME.finditer(line):
                bad.append(f"{rel}:{n}: names {m.group(1)} (a branch on nodes belongs in a route)")
    return bad


def call_state(root):
    """The steps read the call's earlier values and return their own: a function outside
    MUTABLE_CALL that takes Dispatch& or Combine& (not const) is reported."""
    bad = []
    for rel, allowed in MUTABLE_CALL.items():
        f = root / rel
        if not f.exists():
            continue
        text = strip(f.read_text())
        for m in SIGNATURE.finditer(text):
            params = m.group(2)
            mutable = any(not params[:p.start()].rstrip().endswith("const")
                          for p in CALL_PARAM.finditer(params))
            if m.group(1) in allowed or m.group(1) in KEYWORDS or not mutable:
                continue
            n = text.count("\n", 0, m.start()) + 1
            bad.append(f"{rel}:{n}: {m.group(1)} takes the call mutably (a step returns its value; "
                       f"only the outputs' steps may change the call: MUTABLE_CALL)")
    return bad


def strip(text):
    """The text with comments, strings and character literals blanked (line breaks kept)."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append("\n" * text.count("\n", i, j))
            i = j
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            out.append(" ")
            i = j + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def function_name(text, brace):
    """The name before the parameter list that ends before text[brace]."""
    j = text.rfind(")", 0, brace)
    depth = 0
    while j >= 0:
        depth += {")": 1, "(": -1}.get(text[j], 0)
        if depth == 0:
            break
        j -= 1
    m = re.search(r"([\w:~<>]+)\s*$", text[max(0, j - 200):max(0, j)])
    return m.group(1) if m else "a lambda"


def long_functions(path, rel):
    """Functions (and lambdas, if long) whose body spans more than MAX_LINES lines: a brace that
    opens after a ')' (possibly followed by qualifiers) starts a function body; namespaces,
    classes and initialisers do not count, but the functions inside classes do."""
    text = strip(path.read_text())
    found, stack, line = [], [], 1
    for i, c in enumerate(text):
        if c == "\n":
            line += 1
        elif c == "{":
            head = text[max(0, i - 200):i]
            is_fn = re.search(r"\)\s*(const|noexcept|override|final|mutable|->\s*[\w:<>&*\s]+)*\s*$",
                              head) is not None
            stack.append((line, is_fn, function_name(text, i) if is_fn else ""))
        elif c == "}" and stack:
            start, is_fn, name = stack.pop()
            if is_fn and line - start + 1 > MAX_LINES and not any(s[1] for s in stack):
                found.append(f"{rel}:{start}: {name} spans {line - start + 1} lines "
                             f"(more than {MAX_LINES})")
    return found


def length(root):
    bad = []
    for f in files_under(root, "src"):
        rel = f.relative_to(root).as_posix()
        if rel not in KERNEL_BODIES:
            bad += long_functions(f, rel)
    return bad


def selftest():
    """Each check must catch what it exists for: a scratch tree with one offence of each kind."""
    import tempfile
    long_body = "\n".join(["  ++x;"] * (MAX_LINES + 1))
    plants = {
        "src/core/ep/a.cc": '#include "transport/shm/context.h"\n#include <mpi.h>\n'
                            '// MPI_Comm in a comment is fine\nconst char* s = "MPI_OK";\n'
                            'MPI_Comm c;\n',
        "src/sharding/b.cc": '#include "transport/mpi/link.h"\n'
                             'int Tensor::size() const { return 0; }\n',
        "src/transport/i.h": '#include "transport/shm/context.h"\nstruct I { MPI_Request r; };\n',
        "src/transport/mpi/ok.cc": '#include <mpi.h>\nMPI_Comm fine;\n',
        "src/kernels/k.cc": '#include "core/ep/plan.h"\n',
        "src/base/f.cc": "void f(int x) {\n" + long_body + "\n}\n",
        "src/core/ep/dispatch.cc": '#include "core/ep/route.h"\n// relayed() in a comment\n'
                                   'bool f(const Nodes& n) { return n.relay_of(1) > 0; }\n',
        "src/core/ep/relay_dispatch.cc": '#include "core/ep/route.h"\nNodes fine;\n'
                                         'void ok(const Dispatch& c) {}\n'
                                         'int links(int w, Dispatch& c) { return w; }\n',
        "src/core/ep/combine.cc": 'void agree(Combine& c) {}\n'
                                  'void sum(const CombineSum& s, Combine &c);\n'
                                  'void f(std::function<void()> g, Combine* c) {}\n'
                                  'void g(const\n  Combine& c) {}\n',
    }
    want = ["a.cc:1: includes the concrete transport", "a.cc:2: includes <mpi.h>",
            "a.cc:5: names MPI_Comm", "b.cc:1: includes the concrete transport",
            "b.cc:2: defines a member of Tensor", "i.h:1: includes the concrete transport",
            "i.h:2: names MPI_Request",
            "k.cc:1: includes \"core/ep/plan.h\"", "f.cc:1: f spans",
            "dispatch.cc:1: includes \"core/ep/route.h\"", "dispatch.cc:3: names Nodes",
            "dispatch.cc:3: names relay_of", "relay_dispatch.cc:4: links takes the call mutably",
            "combine.cc:2: sum takes the call mutably", "combine.cc:3: f takes the call mutably"]
    with tempfile.TemporaryDirectory() as d:
        root = pathlib.Path(d)
        for rel, text in plants.items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text(text)
        got = layering(root) + length(root)
    missing = [w for w in want if not any(w in g for g in got)]
    extra = [g for g in got if not any(w in g for w in want)]
    for m in missing:
        print(f"structure.py selftest: not reported: {m}")
    for e in extra:
        print(f"structure.py selftest: reported wrongly: {e}")
    if missing or extra:
        return 1
    print(f"structure.py selftest: ok ({len(want)} planted offences reported)")
    return 0


def main():
    if sys.argv[1:] == ["selftest"]:
        return selftest()
    if len(sys.argv) != 3 or sys.argv[1] not in ("layering", "length"):
        print(__doc__)
        return 2
    root = pathlib.Path(sys.argv[2]).resolve()
    if not (root / "src").is_dir():
        print(f"structure.py: {root} has no src/")
        return 2
    bad = layering(root) if sys.argv[1] == "layering" else length(root)
    for b in bad:
        print(b)
    if bad:
        return 1
    print(f"structure.py {sys.argv[1]}: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
