"""rollart's layout: imports point one way, and no module-level import cycle.

The layer order is setup.cfg's ``[importlinter]`` contracts (``lint-imports``, also run
by .ci/run); here they are checked by import-linter's own API so the suite fails too,
and every package and top-level module must be named in the layers. The cycle check
reads every module's top-level imports (not those inside functions, which run later,
nor ``if TYPE_CHECKING:`` ones) and looks for a cycle among rollart's modules: a cycle
there makes the import order matter, the failure Python reports as "partially
initialized module". Cycles closed by an import inside a function are allowed only
where a comment at that import says ``import cycle`` and why.
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
