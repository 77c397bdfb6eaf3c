"""The house rules that need a fresh interpreter: `import stageplan` and the planning path stay torch-free,
the solver and the schedules import no scipy or torch."""

from __future__ import annotations

import subprocess
import sys

from unit.test_house import PKG, _graph, _imports


def test_solver_imports_only_leaf_modules_and_no_scipy() -> None:
    # the solver's instance and probes (partition) and the leaves errors and units; interleaved and the peers'
    # rules use the solver's public checks of its inputs
    leaves = {"stageplan.errors", "stageplan.units"}
    assert _graph()["stageplan.planning.solver"] <= leaves | {"stageplan.planning.partition"}
    assert _graph()["stageplan.planning.partition"] <= leaves
    assert _imports(PKG / "errors.py") == {"__future__"}
    for mod in ("solver", "partition"):
        assert not any(m.startswith("scipy") for m in _imports(PKG / "planning" / f"{mod}.py")), mod
    code = ("import sys, stageplan.planning.solver; "
            "assert 'scipy' not in sys.modules, sorted(m for m in sys.modules if 'scipy' in m)")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_import_stageplan_does_not_import_torch() -> None:
    code = ("import sys, stageplan; assert callable(stageplan.plan); stageplan.Workload; stageplan.Plan; "
            "import stageplan.formats, stageplan.planning, stageplan.report, stageplan.calibration, "
            "stageplan.comparison, stageplan.tuning; "
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch')); "
            "assert 'scipy' not in sys.modules, sorted(m for m in sys.modules if m.startswith('scipy')); "
            "assert stageplan.run.__module__ == 'stageplan.running.launch'; "
            "assert stageplan.profile_model.__module__ == 'stageplan.profiling.profiler'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_planning_path_crosses_at_most_six_modules() -> None:
    """plan(profile, p) from the API down to the solver: the modules whose functions run, besides the records
    it reads and writes (formats) and the leaves (errors, units). Imports are done first (a warm call)."""
    code = r"""
import inspect, sys
import stageplan
prof = stageplan.Profile.load(sys.argv[1])
stageplan.plan(prof, 4)
seen = []
def tracer(frame, event, arg):
    name = frame.f_globals.get("__name__", "")
    if event == "call" and frame.f_code.co_flags & inspect.CO_OPTIMIZED and name.startswith("stageplan"):
        if name not in seen:
            seen.append(name)
sys.settrace(tracer)
stageplan.plan(prof, 4)
sys.settrace(None)
print(" ".join(m for m in seen if not m.startswith("stageplan.formats")
               and m not in ("stageplan", "stageplan.errors", "stageplan.units", "stageplan._io")))
"""
    profile = PKG.parent / "profiles" / "cpu" / "gpt-large.json"
    out = subprocess.run([sys.executable, "-c", code, str(profile)], check=True, capture_output=True,
                         text=True)
    path = out.stdout.split()
    assert path[0] == "stageplan.planning.planner" and "stageplan.planning.solver" in path
    assert len(path) <= 6, path


def test_module_does_not_import_torch() -> None:
    code = "import sys, stageplan.planning.schedules; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
