"""Layers point one way, and knobs have one home (STYLE.md 15-16).

* the engine library never imports a role (``kvship.prefill``, ``kvship.decode``),
  the router, the operator or the app shell;
* no import cycles among kvship modules, except type-only ones
  (``if TYPE_CHECKING:``);
* the router and the operator load without torch or the engine;
* every ``KVSHIP_*`` name in product code is a knob of ``kvship.common.envs``,
  and only that module reads ``os.environ`` for one.

Static checks read the sources with ``ast`` (function-local imports count);
nothing is imported except in the subprocess check.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Iterator, Optional

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {
    "engine": "kvship.engine",
    "prefill": "kvship.prefill",
    "decode": "kvship.decode",
    "router": "kvship.router",
    "operator": "kvship.operator",
    "common": "kvship.common",
    "app": "kvship.app",
}
ENGINE_MUST_NOT_IMPORT = ("kvship.prefill", "kvship.decode", "kvship.router", "kvship.operator", "kvship.app")
ENVS_MODULE = "kvship.common.envs"


@dataclass(frozen=True)
class Source:
    module: str  # dotted name (a package's __init__ is the package)
    path: Path
    tree: ast.Module

    @property
    def is_package(self) -> bool:
        return self.path.name == "__init__.py"

    @property
    def rel(self) -> str:
        return self.path.relative_to(ROOT).as_posix()


@lru_cache(maxsize=1)
def sources() -> dict[str, Source]:
    out = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            module = ".".join([package, *parts])
            out[module] = Source(module, path, ast.parse(path.read_text(), filename=str(path)))
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk_runtime(node: ast.AST) -> Iterator[ast.AST]:
    """Every node below ``node`` except the bodies of ``if TYPE_CHECKING:`` (their ``else`` runs)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for sub in child.orelse:
                yield sub
                yield from _walk_runtime(sub)
            continue
        yield child
        yield from _walk_runtime(child)


def _absolute(src: Source, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = src.module.split(".")
    if not src.is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def runtime_imports(src: Source) -> list[tuple[str, int]]:
    """(module, line) for every import that runs (function-local ones included); ``from p import n`` names
    ``p.n`` when that is a module of ours, else ``p``."""
    known = sources()
    out = []
    for node in _walk_runtime(src.tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(src, node)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.append((sub if sub in known else base, node.lineno))
    return out


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    comps: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, it = work[-1]
            for nxt in it:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        comp.append(top)
                        if top == node:
                            break
                    comps.append(sorted(comp))
    return comps


def test_engine_library_never_imports_a_role_the_router_the_operator_or_the_app():
    bad = []
    for src in sources().values():
        if not src.module.startswith("kvship.engine"):
            continue
        for target, line in runtime_imports(src) + _type_only_imports(src):
            if any(target == p or target.startswith(p + ".") for p in ENGINE_MUST_NOT_IMPORT):
                bad.append(f"{src.rel}:{line} imports {target}")
        # lazy registries name modules as strings ("kvship.x.y:Class")
        for node in ast.walk(src.tree):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and re.fullmatch(r"kvship\.(prefill|decode|router|operator|app)(\.[\w.]+)?(:\w+)?", node.value)
            ):
                bad.append(f"{src.rel}:{node.lineno} names {node.value!r}")
    assert not bad, "the engine must not depend on roles, router, operator or app:\n" + "\n".join(bad)


def _type_only_imports(src: Source) -> list[tuple[str, int]]:
    """Imports under ``if TYPE_CHECKING:`` (they may point anywhere but into layers above the engine)."""
    out = []
    for node in ast.walk(src.tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for sub in node.body:
                for n in ast.walk(sub):
                    if isinstance(n, ast.Import):
                        out += [(a.name, n.lineno) for a in n.names]
                    elif isinstance(n, ast.ImportFrom):
                        out.append((_absolute(src, n), n.lineno))
    return out


def test_no_import_cycles_among_kvship_modules_except_type_only_ones():
    known = sources()
    graph: dict[str, set[str]] = {m: set() for m in known}
    for src in known.values():
        for target, _ in runtime_imports(src):
            if target in known and target != src.module:
                graph[src.module].add(target)
    cycles = [c for c in _strongly_connected(graph) if len(c) > 1]
    assert not cycles, "import cycles (break them, or make the import type-only):\n" + "\n".join(
        " <-> ".join(c) for c in cycles
    )


def test_router_and_operator_load_neither_torch_nor_the_engine():
    code = (
        "import sys; import kvship.router.app, kvship.router.pd, kvship.operator.handlers; "
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'kvship.engine', "
        "'kvship.prefill', 'kvship.decode', 'kvship.app'))); print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"loaded: {out.stdout.strip()}"


# --- knobs -----------------------------------------------------------------------

_KNOB_RE = re.compile(r"KVSHIP_[A-Z0-9_]*[A-Z0-9](_?\*)?")


def _knob_names() -> set[str]:
    names = set()
    for node in ast.walk(sources()[ENVS_MODULE].tree):
        if (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", None) == "Knob"
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            names.add(node.args[0].value)
    return names


def test_every_kvship_name_in_product_code_is_a_knob_of_common_envs():
    knobs = _knob_names()
    assert knobs, "found no Knob(...) in common/envs.py"
    unknown = []
    for src in sources().values():
        text = src.path.read_text()
        for m in _KNOB_RE.finditer(text):
            name = m.group(0)
            line = text.count("\n", 0, m.start()) + 1
            if name.endswith("*"):  # a family in prose, e.g. KVSHIP_FLASHINFER_*_BS
                prefix = name.rstrip("*")
                if not any(k.startswith(prefix) for k in knobs):
                    unknown.append(f"{src.rel}:{line} {name}")
            elif name not in knobs:
                unknown.append(f"{src.rel}:{line} {name}")
    assert not unknown, "KVSHIP_* names not defined in common/envs.py:\n" + "\n".join(unknown)


def _module_str_constants() -> dict[str, dict[str, str]]:
    """module -> {NAME: value} for module-level ``NAME = "..."`` assignments."""
    out: dict[str, dict[str, str]] = {}
    for src in sources().values():
        consts = {}
        for node in src.tree.body:
            if (
                isinstance(node, ast.Assign)
                and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)
            ):
                for t in node.targets:
                    if isinstance(t, ast.Name):
                        consts[t.id] = node.value.value
        out[src.module] = consts
    return out


def _env_key(node: ast.AST) -> Optional[ast.expr]:
    """The key expression of an environment read (``os.environ.get(k)``, ``os.environ[k]``, ``os.getenv(k)``,
    ``k in os.environ``, ``environ.pop(k)`` ...), else None."""

    def is_environ(e: ast.expr) -> bool:
        return (isinstance(e, ast.Attribute) and e.attr == "environ") or (isinstance(e, ast.Name) and e.id == "environ")

    if isinstance(node, ast.Call) and node.args:
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr in ("get", "pop", "setdefault") and is_environ(f.value):
            return node.args[0]
        if isinstance(f, ast.Attribute) and f.attr == "getenv":
            return node.args[0]
        if isinstance(f, ast.Name) and f.id == "getenv":
            return node.args[0]
    if isinstance(node, ast.Subscript) and is_environ(node.value):
        return node.slice
    if (
        isinstance(node, ast.Compare)
        and len(node.ops) == 1
        and isinstance(node.ops[0], (ast.In, ast.NotIn))
        and is_environ(node.comparators[0])
    ):
        return node.left
    return None


def test_only_common_envs_reads_kvship_variables_from_the_environment():
    consts = _module_str_constants()
    bad = []
    for src in sources().values():
        if src.module == ENVS_MODULE:
            continue
        imported: dict[str, str] = {}
        for node in ast.walk(src.tree):
            if isinstance(node, ast.ImportFrom):
                base = _absolute(src, node)
                for alias in node.names:
                    if alias.name in consts.get(base, {}):
                        imported[alias.asname or alias.name] = consts[base][alias.name]
        local = {**consts[src.module], **imported}
        for node in ast.walk(src.tree):
            key = _env_key(node)
            if key is None:
                continue
            if isinstance(key, ast.Constant) and isinstance(key.value, str):
                value: Optional[str] = key.value
            elif isinstance(key, ast.Name):
                value = local.get(key.id)
            else:
                value = None
            if value is None:
                bad.append(
                    f"{src.rel}:{node.lineno} reads an environment variable it does not name "
                    f"(use kvship.common.envs.ENV)"
                )
            elif value.startswith("KVSHIP_"):
                bad.append(f"{src.rel}:{node.lineno} reads {value} (use kvship.common.envs.ENV)")
    assert not bad, "\n".join(bad)
