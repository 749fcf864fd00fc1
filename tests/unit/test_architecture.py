"""The package's shape: every module on its floor (imports only its own floor and lower ones), no import cycles,
the library never imports task code, importing it changes no process-wide state (warning filters), and every
module and function is small enough to read."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
from collections.abc import Iterator

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


# Lowest first. A module may import modules on its own floor or a lower one, never a higher one; a module is on the
# floor of its longest matching prefix, and a module that matches none is an error (place it here).
FLOORS: list[tuple[str, ...]] = [
    # 0 formulas: pure torch
    ("lit_rlhf.algorithms.losses", "lit_rlhf.algorithms.estimators", "lit_rlhf.algorithms.chunked_logprobs"),
    ("lit_rlhf.config", "lit_rlhf.types", "lit_rlhf.registry", "lit_rlhf.trl_names"),  # 1 base
    ("lit_rlhf.models",),  # 2
    ("lit_rlhf.algorithms",),  # 3 the rest of it: experience, objective
    ("lit_rlhf.rewards",),  # 4
    ("lit_rlhf.data", "lit_rlhf.rollout"),  # 5
    ("lit_rlhf.training",),  # 6
    ("lit_rlhf.tasks", "lit_rlhf.preflight"),  # 7 (preflight: checks a whole run, below the CLI)
    ("lit_rlhf.cli",),  # 8
]


def floor_of(module: str) -> int | None:
    """The floor of the longest prefix in FLOORS that `module` is or lies under; None if it matches none."""
    matches = [
        (len(prefix), floor)
        for floor, prefixes in enumerate(FLOORS)
        for prefix in prefixes
        if module == prefix or module.startswith(prefix + ".")
    ]
    return max(matches)[1] if matches else None


def upward_imports(graph: dict[str, set[str]], packages: set[str]) -> list[str]:
    """`a -> b (floor x -> floor y)` for each import of a higher floor. An import of `pkg.mod` also lists `pkg`,
    whose `__init__` it runs; those edges are skipped, as the subpackage `__init__`s import nothing."""
    offenders = []
    for name in sorted(graph):
        for dep in sorted(graph[name] - packages):
            low, high = floor_of(name), floor_of(dep)
            if low is not None and high is not None and high > low:
                offenders.append(f"{name} -> {dep} (floor {low} -> floor {high})")
    return offenders


def test_floors_take_the_longest_prefix_and_report_upward_imports():
    assert floor_of("lit_rlhf.algorithms.losses") == 0 and floor_of("lit_rlhf.algorithms.experience") == 3
    assert floor_of("lit_rlhf.cli") == 8 and floor_of("lit_rlhf.clix") is None and floor_of("lit_rlhf.new") is None
    graph = {"lit_rlhf.models.a": {"lit_rlhf.training.b", "lit_rlhf.algorithms"}, "lit_rlhf.training.b": set()}
    assert upward_imports(graph, {"lit_rlhf.algorithms"}) == [
        "lit_rlhf.models.a -> lit_rlhf.training.b (floor 2 -> floor 6)"
    ]


def test_every_module_imports_only_its_own_floor_or_lower():
    graph = import_graph()
    unplaced = sorted(name for name in graph if floor_of(name) is None)
    assert not unplaced, f"modules on no floor (add them to FLOORS): {unplaced}"
    packages = {module_name(init) for init in PACKAGE.rglob("__init__.py")}
    offenders = upward_imports(graph, packages)
    assert not offenders, "imports of a higher floor:\n" + "\n".join(offenders)


MAX_FUNCTION_LINES = 60


def functions(node: ast.AST, prefix: str = "") -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Every function and method under `node`, nested ones too, with its dotted name (`Class.method`)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + child.name, child
            yield from functions(child, f"{prefix}{child.name}.")
        elif isinstance(child, ast.ClassDef):
            yield from functions(child, f"{prefix}{child.name}.")
        else:
            yield from functions(child, prefix)


def test_every_function_is_at_most_60_lines():
    too_long = [
        f"{path.relative_to(PACKAGE)}::{name} ({node.end_lineno - node.lineno + 1} lines)"
        for path in sorted(PACKAGE.rglob("*.py"))
        for name, node in functions(ast.parse(path.read_text()))
        if node.end_lineno is not None and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not too_long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(too_long)


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


def test_the_rollout_datamodule_and_the_module_meet_only_through_the_handoff():
    """`RolloutDataModule` never reads the module (`trainer.lightning_module`), and the module reads the Trainer's
    DataModule in one place, `Rollouts.setup`, to call `connect` (`lit_rlhf/data/handoff.py`)."""
    sources = {path.relative_to(PACKAGE).as_posix(): path.read_text() for path in PACKAGE.rglob("*.py")}
    assert "lightning_module" not in sources["data/datamodule.py"]
    readers = {name for name, text in sources.items() if ".datamodule" in text and name.startswith("training/")}
    assert readers == {"training/rollouts.py"}
    setup = sources["training/rollouts.py"].split("def setup(", 1)[1].split("\n    def ", 1)[0]
    assert "trainer.datamodule" in setup and ".connect(" in setup
