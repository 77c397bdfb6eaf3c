"""The house's dependency rules, checked by parsing imports (lazy ones too), and the fast tier's own reach:
every module of the package is imported by a file in tests/unit."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "stageplan"


def _name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(p): p for p in PKG.rglob("*.py")}


# Records and planning: no torch, no torch edge, so planning from a stored profile works without torch.
CORE = {m for m in MODULES if m.startswith(("stageplan.formats", "stageplan.planning"))} | {
    f"stageplan.{m}" for m in ("errors", "_io", "_progress", "_version", "workload", "units", "report",
                               "plots", "calibration")}


TORCH_EDGE = {m for m in MODULES if m.startswith(("stageplan.profiling", "stageplan.running"))} | {
    f"stageplan.{m}" for m in ("layers", "measure", "materialize", "zoo", "timing")}


def _imports(path: Path) -> set[str]:
    """Every module a file imports, at the top or inside a function."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names
                         if f"{node.module}.{a.name}" in MODULES)
    return names


def _graph() -> dict[str, set[str]]:
    graph = {}
    for name, path in MODULES.items():
        mods = _imports(path)
        graph[name] = {m for m in mods if m in MODULES and m != name} | (
            {"torch"} if any(m == "torch" or m.startswith("torch.") for m in mods) else set())
    return graph


def test_the_folders_are_the_flow() -> None:
    for folder in ("formats", "planning", "profiling", "running"):
        assert f"stageplan.{folder}" in MODULES, folder
    assert not (PKG / "api.py").exists()


def test_core_modules_do_not_touch_torch() -> None:
    graph = _graph()
    assert "stageplan.planning.solver" in CORE and "stageplan.formats.plan" in CORE
    for mod in CORE:
        assert "torch" not in graph[mod], f"{mod} imports torch"
        assert not (graph[mod] & TORCH_EDGE), f"{mod} imports the torch edge: {graph[mod] & TORCH_EDGE}"


def test_records_import_no_planning_but_the_simulator_behind_plan_simulate() -> None:
    graph = _graph()
    for mod in (m for m in CORE if m.startswith("stageplan.formats")):
        planning = {d for d in graph[mod] if d.startswith("stageplan.planning")}
        allowed = {"stageplan.planning.schedules"} if mod == "stageplan.formats.plan" else set()
        assert planning <= allowed, (mod, planning)


def test_the_run_side_takes_a_plan_and_nothing_else() -> None:
    graph = _graph()
    for mod in (m for m in MODULES if m.startswith("stageplan.running")):
        bad = {d for d in graph[mod] if d.startswith("stageplan.planning")} | (
            graph[mod] & {"stageplan.calibration", "stageplan.comparison", "stageplan.tuning"})
        assert not bad, (mod, bad)


def test_retiming_is_on_the_measuring_side_not_the_profiler() -> None:
    graph = _graph()
    executor = graph["stageplan.running.executor"]
    assert "stageplan.timing" in executor
    assert not {d for d in executor if d.startswith("stageplan.profiling")}, executor


def test_profiler_and_executor_measure_with_the_same_instrument() -> None:
    graph = _graph()
    assert (
        "stageplan.measure" in graph["stageplan.timing"]
        and "stageplan.measure" in graph["stageplan.running.executor"]
    )
    assert "stageplan.timing" in graph["stageplan.profiling.profiler"]
    # no second timer, median or saved-tensor hook anywhere else in the torch edge
    for mod in TORCH_EDGE - {"stageplan.measure"}:
        text = MODULES[mod].read_text()
        for token in ("perf_counter()", "statistics.", "saved_tensors_hooks(", "torch.cuda.Event("):
            if mod in ("stageplan.running.executor", "stageplan.running.link") and token == "perf_counter()":
                continue  # the step's own wall clock and the link's collective probe, not compute timers
            assert token not in text, f"{mod} uses {token}: measure with stageplan.measure"


def test_nothing_imports_the_package_root_from_below() -> None:
    for name, path in MODULES.items():
        if name in ("stageplan", "stageplan.__main__"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                assert all(a.name != "stageplan" for a in node.names), f"{name} imports the package root"
            elif isinstance(node, ast.ImportFrom) and node.module == "stageplan":
                assert all(f"stageplan.{a.name}" in MODULES for a in node.names), (
                    f"{name} imports from the root"
                )


def test_no_module_imports_another_modules_private_names() -> None:
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("stageplan"):
                private = [a.name for a in node.names if a.name.startswith("_")
                           and not a.name.startswith("__") and f"{node.module}.{a.name}" not in MODULES]
                assert not private, f"{name} imports {private} from {node.module}"


def test_nothing_imports_cli_and_no_cycles() -> None:
    graph = _graph()
    assert all("stageplan.cli" not in deps for name, deps in graph.items()
               if name not in ("stageplan.cli", "stageplan.__main__"))
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for dep in graph.get(node, set()) - {"torch"}:
            if dep == "stageplan" or node.startswith(dep + "."):
                continue  # a package's __init__ re-exports its own modules
            assert state.get(dep) != 1, f"import cycle: {' -> '.join([*stack, dep])}"
            if dep not in state:
                visit(dep, [*stack, dep])
        state[node] = 2

    for name in graph:
        if name not in state:
            visit(name, [name])


UNIT = Path(__file__).resolve().parent


def fast_tier_imports() -> dict[str, list[str]]:
    """Each module of the package (``__main__`` aside) with the files in tests/unit that import it: ``import
    stageplan.x``, ``from stageplan.x import y`` and ``from stageplan import x`` count, at the top or inside a
    test. Importing a module runs its packages' ``__init__`` first, so a package counts with any module under
    it."""
    found: dict[str, list[str]] = {name: [] for name in sorted(MODULES) if name != "stageplan.__main__"}
    for path in sorted(UNIT.glob("*.py")):
        for name in _imports(path):
            parts = name.split(".")
            for module in sorted({".".join(parts[:i]) for i in range(1, len(parts) + 1)} & found.keys()):
                if path.name not in found[module]:
                    found[module].append(path.name)
    return found


def test_the_fast_tier_imports_every_module() -> None:
    """`make test` runs tests/unit alone: every module must be imported (and so exercised) by a file there,
    not only by the integration tier's processes. The list is printed (pytest -s, or -rP) to show which files
    reach what."""
    found = fast_tier_imports()
    print("\n".join(f"{name}: {' '.join(files)}" for name, files in found.items()))
    missing = [name for name, files in found.items() if not files]
    assert not missing, (f"no file in tests/unit imports {missing}; give each module a test in "
                         f"tests/unit/test_<module>.py")
