"""The house's dependency rules, checked by parsing imports; and `import stageplan` stays torch-free."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "stageplan"
CORE = {"errors", "_io", "_progress", "_version", "workload", "profile", "costmodel", "solver", "interleaved", "baselines",
        "schedules", "plan", "report", "plots", "runreport", "units"}  # api composes: it may import the torch edge lazily
TORCH_EDGE = {"layers", "measure", "profiler", "estimate", "stages", "executor", "check", "launch", "zoo"}


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


def test_solver_imports_only_leaf_modules_and_no_scipy() -> None:
    # units is a leaf beside errors (it formats the bytes in the solver's messages); both import no other module
    assert _graph()["solver"] <= {"errors", "units"}
    assert _imports(PKG / "errors.py") == {"__future__"}
    assert {m for m in _graph()["units"] if m != "torch"} <= {"errors"}
    assert not any(m.startswith("scipy") for m in _imports(PKG / "solver.py"))
    code = "import sys, stageplan.solver; assert 'scipy' not in sys.modules, sorted(m for m in sys.modules if 'scipy' in m)"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_run_side_takes_a_plan_and_nothing_else() -> None:
    graph = _graph()
    for mod in ("executor", "stages", "launch", "check"):
        assert not graph[mod] & {"solver", "costmodel", "api", "interleaved", "baselines"}, (mod, graph[mod])


def test_profiler_and_executor_measure_with_the_same_instrument() -> None:
    graph = _graph()
    assert "measure" in graph["profiler"] and "measure" in graph["executor"]
    assert "measure" in graph["check"] or "measure" in graph["stages"]
    # no second timer, median or saved-tensor hook anywhere else in the torch edge
    for mod in TORCH_EDGE - {"measure"}:
        text = (PKG / f"{mod}.py").read_text()
        for token in ("perf_counter()", "statistics.", "saved_tensors_hooks(", "torch.cuda.Event("):
            if mod == "executor" and token == "perf_counter()":
                continue  # the step's own wall clock (barrier to optimizer step), not a compute timer
            assert token not in text, f"{mod}.py uses {token}: measure with stageplan.measure"


def test_nothing_imports_the_package_root_from_below() -> None:
    modules = {path.stem for path in PKG.glob("*.py")}
    for path in PKG.glob("*.py"):
        if path.stem in ("__init__", "__main__"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                assert all(a.name != "stageplan" for a in node.names), f"{path.stem} imports the package root"
            elif isinstance(node, ast.ImportFrom) and node.module == "stageplan":
                assert all(a.name in modules for a in node.names), f"{path.stem} imports from the package root"


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
            "import stageplan.solver, stageplan.schedules, stageplan.report, stageplan.costmodel, stageplan.runreport; "
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch')); "
            "assert 'scipy' not in sys.modules, sorted(m for m in sys.modules if m.startswith('scipy')); "
            "assert stageplan.run.__module__ == 'stageplan.launch' and stageplan.profile_model.__module__ == 'stageplan.profiler'")
    subprocess.run([sys.executable, "-c", code], check=True)
