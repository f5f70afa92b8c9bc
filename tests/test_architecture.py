"""The folder tree is the architecture: layers import only downward, nothing imports in a cycle, the
session core and the transports' protocol modules do no I/O, and no large file slips into git.

The layer map is docs/architecture.md's, as data. A violation names the importing module, the line
and the rule; fix the import (move the shared piece down), never the map, unless the design changes.
"""

from __future__ import annotations

import ast
import subprocess
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("duplex", "asr", "dialogue", "tts", "codec", "clients")
STAGES = ("codec", "asr", "tts", "dialogue")
RECIPES = tuple(f"{s}.training" for s in STAGES)

#: group -> the groups it may import (besides itself). Groups are matched by the longest prefix.
ALLOWED: dict[str, set[str]] = {
    "duplex": set(),  # the package itself (its __init__ is empty); every module lives in a layer below
    "duplex.base": set(),
    "codec": {"duplex.base"},
    "asr": {"duplex.base", "codec"},
    "tts": {"duplex.base", "codec"},
    "dialogue": {"duplex.base", "codec"},
    "duplex.core": {"duplex.base", "codec"},  # codec.pcm: the one PCM16 conversion
    **{r: {"duplex.base", *STAGES, *RECIPES} for r in RECIPES},
    "duplex.runtime": {"duplex.base", "duplex.core", *STAGES},
    "duplex.transports": {"duplex.base", "duplex.core", "duplex.runtime", "codec"},
    "duplex.testing": {"duplex.base", "duplex.core", "duplex.runtime", "duplex.transports", "codec"},
}
#: the top: evaluations, benchmarks and clients may use everything below them; the CLI everything
TOP = {
    "duplex.eval": {
        "duplex.base",
        "duplex.core",
        "duplex.runtime",
        "duplex.transports",
        "duplex.testing",
        *STAGES,
        *RECIPES,
    },
    "clients": {"duplex.base", "codec"},
}
TOP["duplex.bench"] = TOP["duplex.eval"] | {"duplex.eval"}
TOP["duplex.cli"] = set(ALLOWED) | set(TOP) | {"duplex.cli"}
ALLOWED.update(TOP)

#: modules that must stay sans-I/O: no event loop, sockets or model code
NO_IO = ("asyncio", "websockets", "torch", "socket", "onnxruntime", "transformers")
SANS_IO = (
    "duplex.core",
    "duplex.transports.wire_audio",
    "duplex.transports.native_protocol",
    "duplex.transports.twilio_protocol",
    "duplex.transports.audiosocket_protocol",
    "duplex.transports.realtime_protocol",
    "duplex.transports.auth",
    "duplex.base.limits",
)


def module_files() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            mods[name] = path
    return mods


def imports_of(name: str, path: Path) -> list[tuple[str, int]]:
    """Every import in the module (at any depth, TYPE_CHECKING ones included), resolved to module names."""
    found = []
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if is_pkg else 0)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found += [(f"{mod}.{a.name}", node.lineno) for a in node.names] + [(mod, node.lineno)]
    return found


def graph() -> dict[str, dict[str, int]]:
    mods = module_files()
    edges: dict[str, dict[str, int]] = defaultdict(dict)
    for name, path in mods.items():
        for target, line in imports_of(name, path):
            # the deepest of our modules the import names ("from a.b import c": a.b.c if c is a module)
            while target and target not in mods:
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + "."):
                edges[name].setdefault(target, line)
    return edges


def group_of(module: str) -> str:
    best = ""
    for g in ALLOWED:
        if (module == g or module.startswith(g + ".")) and len(g) > len(best):
            best = g
    assert best, f"{module} belongs to no layer: add its package to ALLOWED in tests/test_architecture.py"
    return best


def test_every_module_has_a_layer() -> None:
    for name in module_files():
        group_of(name)


def test_imports_only_go_down() -> None:
    wrong = []
    for src, targets in sorted(graph().items()):
        gs = group_of(src)
        for dst, line in sorted(targets.items()):
            gd = group_of(dst)
            if gd != gs and gd not in ALLOWED[gs]:
                wrong.append(f"{src}:{line} imports {dst} ({gs} may import only {sorted(ALLOWED[gs])})")
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles() -> None:
    edges = graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(module_files()):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


@pytest.mark.parametrize("prefix", SANS_IO)
def test_sans_io_modules_import_no_io(prefix: str) -> None:
    mods = module_files()
    checked = [name for name in mods if name == prefix or name.startswith(prefix + ".")]
    assert checked, f"{prefix} names no module: the check would pass vacuously (renamed or moved?)"
    wrong = []
    for name in checked:
        for target, line in imports_of(name, mods[name]):
            if target.split(".")[0] in NO_IO:
                wrong.append(f"{name}:{line} imports {target}")
    assert not wrong, "\n".join(wrong)


def test_no_large_files_in_git() -> None:
    """Weights ship only when a profile uses them; data and results stay small (git keeps every blob)."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=False).stdout
    if not listed:
        pytest.skip("not a git checkout")
    allowed_big = {"asr/weights/fc_small.nemo"}  # the streaming ASR's shipped model (issue 20 replaces it)
    big = [
        f"{f} ({(ROOT / f).stat().st_size >> 20} MiB)"
        for f in listed.decode().split("\0")
        if f and (ROOT / f).is_file() and (ROOT / f).stat().st_size > 8 << 20 and f not in allowed_big
    ]
    assert not big, f"files over 8 MiB in git: {big}"
