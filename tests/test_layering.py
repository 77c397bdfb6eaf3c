"""The house's dependency rules, checked by parsing imports; and `import stageplan` stays torch-free."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "stageplan"
CORE = {"errors", "_io", "workload", "profile", "costmodel", "solver", "schedules", "plan", "report", "plots", "runreport",
        "units"}  # api composes: it may import the torch edge lazily, inside functions
TORCH_EDGE = {"layers", "profiler", "executor", "zoo"}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            if node.module == "stageplan":
                names.update(f"stageplan.{a.name}" for a in node.names)
    return names


def _graph() -> dict[str, set[str]]:
    graph = {}
    for path in PKG.glob("*.py"):
        mods = _imports(path)
        graph[path.stem] = {m.split(".")[1] for m in mods if m.startswith("stageplan.")} | (
            {"torch"} if any(m == "torch" or m.startswith("torch.") for m in mods) else set())
    return graph


def test_core_modules_do_not_touch_torch() -> None:
    graph = _graph()
    for mod in CORE & graph.keys():
        assert "torch" not in graph[mod], f"{mod} imports torch"
        assert not (graph[mod] & TORCH_EDGE), f"{mod} imports the torch edge: {graph[mod] & TORCH_EDGE}"


def test_solver_imports_only_the_leaf_errors_module() -> None:
    assert _graph()["solver"] <= {"errors"}
    assert _imports(PKG / "errors.py") == {"__future__"}


def test_executor_takes_a_plan_and_nothing_else() -> None:
    graph = _graph()
    assert not graph["executor"] & {"solver", "costmodel", "api"}, graph["executor"]


def test_nothing_imports_cli_and_no_cycles() -> None:
    graph = _graph()
    assert all("cli" not in deps for name, deps in graph.items() if name not in ("cli", "__main__"))
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for dep in graph.get(node, set()) - {"torch", "__init__"}:
            assert state.get(dep) != 1, f"import cycle: {' -> '.join([*stack, dep])}"
            if dep not in state:
                visit(dep, [*stack, dep])
        state[node] = 2

    for name in graph:
        if name not in state and name != "__init__":
            visit(name, [name])


def test_import_stageplan_does_not_import_torch() -> None:
    code = ("import sys, stageplan, stageplan.plan; assert callable(stageplan.plan); stageplan.Workload; stageplan.Plan; "
            "import stageplan.solver, stageplan.schedules, stageplan.report; "
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))")
    subprocess.run([sys.executable, "-c", code], check=True)
