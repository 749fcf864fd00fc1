"""The package's shape: no import cycles, the library never imports task code, importing it changes no
process-wide state (warning filters), and every module is small enough to read."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "lit_rlhf"


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: pathlib.Path, known: set[str]) -> set[str]:
    """lit_rlhf modules that `path` imports anywhere (module level or inside functions), with the packages
    whose `__init__` each import runs."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        for name in names:
            parts = name.split(".")
            found.update(".".join(parts[:i]) for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in known)
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the lit_rlhf modules it imports. The top-level package's re-exports are left out: only the
    modules' own dependencies can form a cycle (subpackage `__init__`s import nothing, see below)."""
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    known = set(files) - {"lit_rlhf"}
    return {name: imported_modules(path, known) - {name} for name, path in files.items() if name != "lit_rlhf"}


def test_subpackage_inits_import_nothing():
    """So importing any module never runs another folder's code by the side door."""
    for init in PACKAGE.glob("*/__init__.py"):
        body = ast.parse(init.read_text()).body
        assert not [n for n in body if isinstance(n, (ast.Import, ast.ImportFrom))], init


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_detects_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_in_the_package():
    graph = import_graph()
    assert "lit_rlhf.training.module" in graph and "lit_rlhf.rollout.sampler" in graph
    assert find_cycle(graph) is None


def test_the_library_never_imports_task_code():
    offenders = {
        name: sorted(m for m in deps if m.startswith("lit_rlhf.tasks"))
        for name, deps in import_graph().items()
        if not name.startswith("lit_rlhf.tasks")
    }
    assert {name: deps for name, deps in offenders.items() if deps} == {}


def test_importing_the_package_installs_no_warning_filters():
    code = (
        "import warnings, lightning, torch, transformers\n"
        "before = list(warnings.filters)\n"
        "import lit_rlhf, lit_rlhf.cli, lit_rlhf.registry\n"
        "from lit_rlhf.registry import get_task\n"
        "get_task('builtin:digits', 'test')\n"
        "added = [f for f in warnings.filters if f not in before]\n"
        "print(added)\n"
        "assert added == [], added\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)


def test_the_module_stays_slim_and_its_training_step_reads_as_five_phases():
    source = (PACKAGE / "training" / "module.py").read_text()
    assert len(source.splitlines()) < 300
    step = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef) and n.name == "training_step")
    assert step.end_lineno - step.lineno + 1 < 40
    body = ast.get_source_segment(source, step)
    assert [f"# {i}. " in body for i in range(1, 6)] == [True] * 5
