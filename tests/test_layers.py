"""rollart's layout: imports point one way, and no module-level import cycle.

The layer order is setup.cfg's ``[importlinter]`` contracts (``lint-imports``, also run
by .ci/run); here they are checked by import-linter's own API so the suite fails too,
and every package and top-level module must be named in the layers. The cycle check
reads every module's top-level imports (not those inside functions, which run later,
nor ``if TYPE_CHECKING:`` ones) and looks for a cycle among rollart's modules: a cycle
there makes the import order matter, the failure Python reports as "partially
initialized module". Cycles closed by an import inside a function are allowed only
where a comment at that import says ``import cycle`` and why. Between rollart's top-level
packages (``rollart.env``, ``rollart.config``, ...) no cycle at all, counting imports
inside functions too: a cycle there is a package that does not know its layer. The ones
that stay are listed with their reason (``PACKAGE_CYCLES``, ``SHIMS``).
"""

import ast
import configparser
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "rollart"


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _top_level_imports(path: Path, modules: set[str]) -> set[str]:
    """rollart modules ``path`` imports at module level (the most specific one named)."""
    tree = ast.parse(path.read_text())
    me = _module(path)
    out = set()

    def visit(body):
        for node in body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            if isinstance(node, (ast.If, ast.Try)):
                for block in (node.body, getattr(node, "orelse", []),
                              getattr(node, "finalbody", []),
                              *[h.body for h in getattr(node, "handlers", [])]):
                    visit(block)
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
            for n in names:
                while n and n not in modules:
                    n = n.rpartition(".")[0]
                if n and n != me and n.startswith("rollart"):
                    out.add(n)
    visit(tree.body)
    return out


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (module -> modules), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(m):
        state[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (found := dfs(n)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := dfs(m)):
            return found
    return None


#: deprecated re-exports kept for one release at old rollart.env paths whose new home is
#: in a package above env (setup.cfg ignores the same imports): each imports its new
#: home, so its imports are left out of the package graph
SHIMS = {
    "rollart.env.agent": "rollart.agents.agent",
    "rollart.env.corpus": "rollart.corpus",
    "rollart.env.endpoint": "rollart.agents.endpoint",
    "rollart.env.faults": "rollart.chaos.faults",
    "rollart.env.template_support": "rollart.config.templates",
    "rollart.env.workload": "rollart.chaos.workload",
}

#: package cycles that stay, each with its reason
PACKAGE_CYCLES = {
    frozenset({"rollart.agents", "rollart.env"}):
        "one joined layer (setup.cfg `env : agents`): an AgentTask is env's Task, and env's "
        "runner plays it through agents' endpoint; the forbidden contracts order the modules",
}


def _all_imports(path: Path, modules: set[str]) -> dict[str, int]:
    """rollart modules ``path`` imports anywhere (module level and inside functions; not
    in ``if TYPE_CHECKING:`` blocks), each with the line of its first import."""
    tree = ast.parse(path.read_text())
    me = _module(path)
    skipped = {id(n) for node in ast.walk(tree)
               if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
               for inner in node.body for n in ast.walk(inner)}
    out: dict[str, int] = {}
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the importing module's package
                package = me.split(".") if path.name == "__init__.py" else me.split(".")[:-1]
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        for n in names:
            while n and n not in modules:
                n = n.rpartition(".")[0]
            if n and n != me and n.startswith("rollart"):
                out.setdefault(n, node.lineno)
    return out


def _package(module: str) -> str | None:
    """The top-level package (or module) of rollart ``module`` is in; None for rollart."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else None


def package_graph() -> dict[str, dict[str, list[str]]]:
    """rollart's top-level packages -> the packages they import (anywhere, shims left
    out), each edge with the imports that make it (``module:line -> module``). The root
    package (the public API, importing everything lazily) is not a node."""
    files = sorted(PACKAGE.rglob("*.py"))
    modules = {_module(p) for p in files}
    graph: dict[str, dict[str, list[str]]] = {}
    for p in files:
        me = _module(p)
        if me in SHIMS or _package(me) is None:
            continue
        for n, line in _all_imports(p, modules).items():
            a, b = _package(me), _package(n)
            if b is not None and a != b:
                graph.setdefault(a, {}).setdefault(b, []).append(f"{me}:{line} -> {n}")
    return graph


def package_cycles(graph: dict) -> list[frozenset[str]]:
    """The strongly connected sets of ``graph``'s nodes larger than one (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out = []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(frozenset(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_between_rollart_packages():
    """No cycle between rollart's top-level packages, imports inside functions counted,
    but the listed ones (``PACKAGE_CYCLES``: each still a cycle, or its entry goes)."""
    graph = package_graph()
    found = package_cycles(graph)
    new = [sorted(c) for c in found if c not in PACKAGE_CYCLES]
    why = [f"{a} -> {b}: {', '.join(graph[a][b][:3])}"
           for c in new for a in c for b in c if b in graph.get(a, {})]
    assert new == [], "package import cycles: " + "; ".join(why)
    assert set(PACKAGE_CYCLES) - set(found) == set(), "listed cycles that are gone"


def test_the_shims_are_deprecated_re_exports():
    """Each module whose imports the package graph leaves out is a deprecated re-export of
    its new home (it says so in its docstring and warns)."""
    for module, home in SHIMS.items():
        text = (ROOT / (module.replace(".", "/") + ".py")).read_text()
        assert text.startswith('"""Deprecated'), module
        assert f"from {home} import" in text and "DeprecationWarning" in text, module


def test_the_package_cycle_check_finds_a_planted_import():
    graph = package_graph()
    assert package_cycles(graph) == list(PACKAGE_CYCLES)
    graph.setdefault("rollart.types", {})["rollart.trainer"] = ["planted"]  # types is lowest
    new = [c for c in package_cycles(graph) if c not in PACKAGE_CYCLES]
    assert len(new) == 1 and {"rollart.trainer", "rollart.types"} <= new[0]


def test_no_module_level_import_cycle_in_rollart():
    files = sorted(PACKAGE.rglob("*.py"))
    modules = {_module(p) for p in files}
    graph = {_module(p): _top_level_imports(p, modules) for p in files}
    # a package's __init__ importing its own submodules is not a cycle by itself
    graph = {m: {n for n in deps if not (m != "rollart" and n.startswith(m + "."))}
             for m, deps in graph.items()}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_the_cycle_check_finds_a_planted_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_imports_point_down_the_layers():
    """setup.cfg's layer contract holds (``lint-imports`` prints why if not)."""
    import importlinter  # noqa: F401 - the test extra's; missing is a failure, not a skip

    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    assert cfg.get("importlinter", "root_package") == "rollart"
    out = subprocess.run([sys.executable, "-c", "from importlinter.cli import "
                          "lint_imports_command; lint_imports_command()"],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "3 kept, 0 broken" in out.stdout


def test_the_layers_name_every_package():
    """A package the contract does not name is a package nothing checks."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    named = {n.strip() for line in cfg.get("importlinter:contract:layers", "layers").split("\n")
             for n in line.replace("|", ":").split(":") if n.strip()}
    children = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    children |= {p.stem for p in PACKAGE.glob("*.py")} - {"__init__", "__main__", "_lazy"}
    assert children - named == set()


def test_function_level_import_cycles_say_why():
    """Every import inside a function that closes a cycle has an ``import cycle`` comment
    on its line or the line above (the reason it is not at the top)."""
    grimp = pytest.importorskip("grimp")  # import-linter's; the test extra installs it
    graph = grimp.build_graph("rollart", exclude_type_checking_imports=True, cache_dir=None)
    deps = {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    silent = []
    for a, bs in deps.items():
        for b in bs:
            if not graph.find_shortest_chain(importer=b, imported=a):
                continue  # no way back: not in a cycle
            for d in graph.get_import_details(importer=a, imported=b):
                line = d["line_contents"]
                path = PACKAGE.parent / (a.replace(".", "/") + ".py")
                if not path.exists():
                    path = PACKAGE.parent / a.replace(".", "/") / "__init__.py"
                lines = path.read_text().splitlines()
                text = lines[d["line_number"] - 1]
                if text == text.lstrip():
                    continue  # a top-level import: test_no_module_level_import_cycle_in_rollart
                if "import cycle" not in text + lines[d["line_number"] - 2]:
                    silent.append(f"{a}:{d['line_number']} {line}")
    assert silent == []


def test_the_top_level_holds_few_modules():
    """``rollart/`` shows its planes as packages; only a few modules sit beside them."""
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 8, top
