"""make bench's record: each run's figures appended to benchmarks/results/ (one JSON file per run), and the
tables of docs/accuracy.md regenerated from every record there.

A record holds the date, the commit, the host (CPU model, cores, load average at the start and the end), the
torch and Python versions and every figure the benches returned, by section (``{"solver": {...},
"executor": {...}}``, each a flat mapping of a figure's key to a number). The tables between
``<!-- begin: NAME -->`` and ``<!-- end: NAME -->`` in docs/accuracy.md belong to this generator
(:data:`TABLES` says what each holds); the text outside them is written by hand. A table row summarises one
figure over all the records that hold it: the median, the range, the worst, and for a figure with a goal how
many runs met it, so that no single run stands for the host.

Run alone: ``python benchmarks/results.py --regenerate`` rewrites the tables from the records as they are.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOC = ROOT / "docs" / "accuracy.md"
SCHEMA = "stageplan.bench/1"


class RecordError(ValueError):
    """A record or a document the generator cannot use (the benchmarks are not part of the package, so this
    is their own error, not StageplanError)."""


# ----------------------------------------------------------------------------------------------------------
# Writing a record


def host() -> dict[str, Any]:
    """The run's circumstances: UTC date, commit (and whether the tree had changes), CPU model and cores, the
    1/5/15-minute load averages now, torch and Python versions."""
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                                  check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return ""

    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        import torch

        torch_version = str(torch.__version__)
    except ImportError:
        torch_version = ""
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": git("rev-parse", "--short", "HEAD"), "dirty": bool(git("status", "--porcelain",
                                                                              "--untracked-files=no")),
            "cpu_model": cpu, "cpus": os.cpu_count(), "load_average": list(os.getloadavg()),
            "torch": torch_version, "python": platform.python_version()}


def record(sections: Mapping[str, Mapping[str, float | int | None]], *, start: Mapping[str, Any],
           wall_s: float, directory: Path = RESULTS) -> Path:
    """Write one run's record: ``start`` (:func:`host` taken before the benches), the load average at the end,
    the bench's wall time and every section's figures. The file is named by date and commit, written to a
    temporary file and moved into place (a crash leaves no half record). Returns its path."""
    for name, figures in sections.items():
        for key, value in figures.items():
            if value is not None and not isinstance(value, (int, float)):
                raise RecordError(f"figure {name}.{key} is {value!r}; a record holds numbers (or null)")
    rec = {"schema": SCHEMA, **start, "load_average_end": list(os.getloadavg()), "wall_s": wall_s,
           "sections": {k: dict(v) for k, v in sections.items()}}
    directory.mkdir(parents=True, exist_ok=True)
    stamp = str(start["date"]).replace(":", "").replace("+0000", "Z")
    path = directory / f"{stamp}-{start.get('commit') or 'nocommit'}.json"
    fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(rec, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)
    return path


def load_records(directory: Path = RESULTS) -> list[dict[str, Any]]:
    """Every record in ``directory``, oldest first; a record of another schema is refused."""
    out = []
    for path in sorted(directory.glob("*.json")):
        rec = json.loads(path.read_text(encoding="utf-8"))
        if rec.get("schema") != SCHEMA:
            raise RecordError(f"{path.name} has schema {rec.get('schema')!r}, this generator reads "
                              f"{SCHEMA!r}; "
                              "move it out of benchmarks/results/ or convert it")
        out.append(rec)
    return sorted(out, key=lambda r: str(r["date"]))


# ----------------------------------------------------------------------------------------------------------
# Summaries of one figure over the records


def pct(x: float) -> str:
    return f"{x * 100:.1f}%"


def ms(x: float) -> str:
    return f"{x * 1e3:.1f} ms" if x >= 0.01 else f"{x * 1e3:.2f} ms"


def times(x: float) -> str:
    return f"{x:.2f}×"


def number(x: float) -> str:
    return f"{x:.3f}"


def seconds(x: float) -> str:
    return f"{x:.0f} s"


@dataclasses.dataclass(frozen=True)
class Row:
    """One table row: a figure (``section.key`` in every record) and how to show it. ``goal`` (with
    ``worst``: "max" for an error, where lower is better; "min" for a share or a gain) counts the runs that
    met it."""

    label: str
    section: str
    key: str
    fmt: Callable[[float], str] = pct
    goal: float | None = None
    worst: str = "max"
    command: str = "`make bench`"

    def values(self, records: Sequence[Mapping[str, Any]]) -> list[float]:
        out = []
        for rec in records:
            value = (rec.get("sections", {}).get(self.section) or {}).get(self.key)
            if value is not None:
                out.append(float(value))
        return out

    def cell(self, records: Sequence[Mapping[str, Any]]) -> str:
        """The figure over the records that hold it: one run is said to be one; more give the median, the
        range and the worst; a goal adds how many met it."""
        vals = self.values(records)
        if not vals:
            return "not measured yet"
        worst = max(vals) if self.worst == "max" else min(vals)
        met = ""
        if self.goal is not None:
            ok = sum(v <= self.goal if self.worst == "max" else v >= self.goal for v in vals)
            met = f"; within {self.fmt(self.goal)} in {ok} of {len(vals)}" if self.worst == "max" else \
                f"; at least {self.fmt(self.goal)} in {ok} of {len(vals)}"
        if len(vals) == 1:
            return f"{self.fmt(vals[0])} (one run{met})"
        return (f"median {self.fmt(statistics.median(vals))} over {len(vals)} runs "
                f"({self.fmt(min(vals))}–{self.fmt(max(vals))}); worst {self.fmt(worst)}{met}")


def hosts(records: Sequence[Mapping[str, Any]]) -> str:
    """The records' hosts and dates in a few words: each CPU model once, and the first and last date."""
    if not records:
        return "—"
    cpus = sorted({str(r.get("cpu_model") or "unknown CPU") for r in records})
    dates = sorted(str(r["date"])[:10] for r in records)
    span = dates[0] if dates[0] == dates[-1] else f"{dates[0]} to {dates[-1]}"
    return f"{'; '.join(cpus)}, {span}"


def table(rows: Sequence[Row], records: Sequence[Mapping[str, Any]]) -> str:
    lines = ["| figure | over the recorded runs | command | hosts / dates |", "|---|---|---|---|"]
    for row in rows:
        held = [r for r in records if row.values([r])]
        label = row.label.replace("|", "\\|")  # an |error| inside a Markdown table cell
        lines.append(f"| {label} | {row.cell(records)} | {row.command} | {hosts(held)} |")
    return "\n".join(lines)


def runs_table(records: Sequence[Mapping[str, Any]]) -> str:
    """One line per record: what a reader needs to judge the figures (host, load, versions, wall time)."""
    lines = ["| date (UTC) | commit | CPU | cores | load average at start / end (1 min) | torch "
             "| bench wall time |",
             "|---|---|---|---|---|---|---|"]
    for r in records:
        start, end = r.get("load_average") or [float("nan")], r.get("load_average_end") or [float("nan")]
        commit = f"{r.get('commit') or '—'}{' (with changes)' if r.get('dirty') else ''}"
        lines.append(f"| {str(r['date'])[:16].replace('T', ' ')} | {commit} | {r.get('cpu_model') or '—'} | "
                     f"{r.get('cpus') or '—'} | {start[0]:.2f} / {end[0]:.2f} | {r.get('torch') or '—'} | "
                     f"{seconds(float(r.get('wall_s') or 0.0))} |")
    if not records:
        lines.append("| — | — | — | — | — | — | — |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------
# What each generated table holds

_EXEC = "`make bench` (executor)"
_CAL = "`make bench` (calibration)"
_PROF = "`make bench` (profiler)"
_SOLVER = "`make bench` (solver)"
_LAYOUT = "`make bench` (layout)"
_REPL = "`make bench` (replicas)"
_MEM = "`make bench-large` (memory: `benchmarks/bench_memory.py`)"
_LARGE = "`make bench-large` (large: `benchmarks/bench_large.py`)"

TABLES: dict[str, Sequence[Row] | None] = {
    "runs": None,  # the records themselves
    "solver": [
        Row("splits at the optimal bottleneck, stageplan `optimal`", "solver", "optimal_share", pct,
            command=_SOLVER, worst="min"),
        Row("splits at the optimal bottleneck, DeepSpeed's balanced DP on measured time", "solver",
            "balanced_share", pct, command=_SOLVER, worst="min"),
        Row("splits at the optimal bottleneck, parameter balance (DeepSpeed's default)", "solver",
            "parameters_share", pct, command=_SOLVER, worst="min"),
        Row("splits at the optimal bottleneck, equal layers (Megatron-LM's default)", "solver",
            "uniform_share", pct, command=_SOLVER, worst="min"),
        Row("solve, 1,000 layers × 64 stages, 1F1B memory rows, no memory limit", "solver",
            "solve_no_limit_s", ms, command=_SOLVER),
        Row("the same, times faster than an O(L²p) DP", "solver", "speedup_no_limit", times, command=_SOLVER,
            worst="min"),
        Row("the same with a binding memory limit", "solver", "solve_limit_s", ms, command=_SOLVER),
        Row("the same, times faster than the DP", "solver", "speedup_limit", times, command=_SOLVER,
            worst="min"),
        Row("solve, 10,000 layers × 128 stages", "solver", "solve_10000_s", ms, command=_SOLVER),
    ],
    "simulator": [
        Row("bubble fraction of balanced GPipe and 1F1B, largest |simulated − (p − 1)/(m + p − 1)|",
            "simulator", "bubble_max_abs_diff", number, command="`make bench` (simulator)"),
    ],
    "profiler": [
        Row("repeatability, default (stage order): a counted layer's worst difference", "profiler",
            "repeat_default", goal=0.05, command=_PROF),
        Row("repeatability, `--order layer`", "profiler", "repeat_order_layer", goal=0.05, command=_PROF),
        Row("repeatability, `--min-time 20`", "profiler", "repeat_min_time_20", goal=0.05, command=_PROF),
        Row("repeatability, `--processes 3`", "profiler", "repeat_processes_3", goal=0.05, command=_PROF),
        Row("fixed work (no stageplan code) in neighbouring fresh processes: the largest move of its three "
            "pieces", "profiler", "fixed_work_worst_move", goal=0.05, command=_PROF),
        Row("profile wall time, stage order ÷ layer order (12-layer GPT, d_model 512)", "profiler",
            "wall_stage_over_layer", times, command=_PROF),
    ],
    "executor": [
        Row("per-rank compute error, wall clock, a bench's median", "executor", "compute_median", goal=0.10,
            command=_EXEC),
        Row("per-rank compute error, wall clock, a bench's worst", "executor", "compute_worst", goal=0.20,
            command=_EXEC),
        Row("per-rank compute error, thread CPU time, a bench's median", "executor", "compute_cpu_median",
            goal=0.10, command=_EXEC),
        Row("step error, a bench's median", "executor", "step_median", goal=0.15, command=_EXEC),
        Row("step error, a bench's worst", "executor", "step_worst", goal=0.25, command=_EXEC),
        Row("optimal over uniform, measured step ratio, a bench's median", "executor", "gain_measured_median",
            times, worst="min", command=_EXEC),
        Row("the fixed kernel's slowest ÷ fastest within a bench", "executor", "fixed_kernel_spread", times,
            command=_EXEC),
    ],
    "tune": [
        Row("`tune`, m = 4: the final plan on fresh runs (repeatability), |error|", "executor",
            "tune_m4_repeatability", goal=0.05, command=_EXEC),
        Row("`tune`, m = 8: the same", "executor", "tune_m8_repeatability", goal=0.05, command=_EXEC),
        Row("`tune`, m = 4: other splits it ran, priced from the calibrated profile (prediction), worst "
            "|error|", "executor", "tune_m4_prediction_worst", goal=0.20, command=_EXEC),
        Row("`tune`, m = 8: the same", "executor", "tune_m8_prediction_worst", goal=0.20, command=_EXEC),
        Row("`tune`'s final plan over the equal-layer split, measured, m = 4", "executor",
            "tune_m4_gain_measured", times, worst="min", command=_EXEC),
        Row("the same, m = 8", "executor", "tune_m8_gain_measured", times, worst="min", command=_EXEC),
        Row("the same predicted, m = 8", "executor", "tune_m8_gain_predicted", times, worst="min",
            command=_EXEC),
    ],
    "layout": [
        Row("estimating LLaMA-3-70B's 16 (b, t) profiles for the H100 (seq 8192)", "layout", "estimate_s",
            seconds, goal=180.0, command=_LAYOUT),
        Row("the same, peak RSS (GB)", "layout", "estimate_peak_rss_gb", number, goal=4.0, command=_LAYOUT),
        Row("layout search, LLaMA-3-70B, default grid, global batch 1024, 64 devices", "layout",
            "search_64_s", seconds, goal=2.0, command=_LAYOUT),
        Row("the same, 512 devices", "layout", "search_512_s", seconds, goal=10.0, command=_LAYOUT),
        Row("64 devices: candidates priced, of the grid's 7,568", "layout", "search_64_priced", number,
            command=_LAYOUT),
        Row("64 devices, every bound off: the same best (1 = yes)", "layout", "proof_64_same_best", number,
            worst="min", goal=1.0, command=_LAYOUT),
    ],
    "replicas": [
        Row("replicas, skewed GPT, 2 ranks (2 x 1, and 1 x 2 under ddp, zero1, fsdp): step |measured ÷ "
            "predicted − 1|, median over the runs", "replicas", "step_error_median", goal=0.15,
            command=_REPL),
        Row("the same: each rank's data-parallel sync, priced with the measured link, median", "replicas",
            "sync_error_median", goal=0.25, command=_REPL),
        Row("1 GB GPT 2 x 2, Adam, ddp/zero1/fsdp: held ÷ plan by kind (parameters, gradients, shards, "
            "states), worst |error|", "replicas", "memory_kind_error_worst", goal=0.15, command=_REPL),
        Row("the same: resident memory above each rank's baseline ÷ the plan's total, worst |error|",
            "replicas", "memory_rss_error_worst", goal=0.20, command=_REPL),
        Row("2 x 2 (four ranks on two cores, information): ddp step, measured ÷ predicted", "replicas",
            "step_ratio_2x2_ddp", times, command=_REPL),
        Row("ranking of the 4-rank layouts (4 x 1; 2 x 2, 1 x 4 x ddp/zero1/fsdp), each plan's step priced "
            "on this host's 2 cores: pairs predicted apart by more than twice their measured spread",
            "replicas", "ranking_host_pairs_checked", number, command=_REPL),
        Row("the same: share of those pairs measured in the predicted order", "replicas",
            "ranking_host_in_order_share", worst="min", goal=1.0, command=_REPL),
        Row("the same priced on 4 devices (information: four ranks share two cores here): pairs checked",
            "replicas", "ranking_pairs_checked", number, command=_REPL),
        Row("the same: share measured in the predicted order", "replicas", "ranking_in_order_share",
            worst="min", command=_REPL),
    ],
    "memory": [
        Row("a 4-rank run of a 1.97 GB fp32 GPT (d_model 1280, untied), SGD, 1F1B, m = 4: the worst rank's "
            "measured ÷ predicted, as a fold either way (max(x, 1/x))", "memory", "rank_fold_worst", times,
            goal=1.15, command=_MEM),
        Row("the same, the median rank", "memory", "rank_fold_median", times, goal=1.15, command=_MEM),
        Row("the same run: the process tree's peak, sampled every 50 ms (GB; each process's anonymous pages, "
            "the file-backed ones once)", "memory", "tree_peak_gb", number, command=_MEM),
        Row("the tree's peak ÷ its bound (2.2 × the weights + 0.6 GB a rank)", "memory",
            "tree_peak_over_bound", times, goal=1.0, command=_MEM),
        Row("that sum against the kernel's proportional set sizes, read together once a second: a run's "
            "median difference", "memory", "tree_pss_check_median", pct, command=_MEM),
    ],
    "large": [
        Row("LLaMA-2-7B (27 GB in fp32) profiled layer at a time, seq 128: wall time", "large", "llama2_7b_s",
            seconds, goal=900.0, command=_LARGE),
        Row("the same, peak RSS (GB)", "large", "llama2_7b_peak_rss_gb", number, goal=8.0, command=_LARGE),
        Row("Qwen2-7B's shape (152k vocabulary, untied), `stageplan profile hf --set preset=qwen2-7b --set "
            "seq_len=128 --microbatch-size 1`: wall time", "large", "qwen2_7b_s", seconds, goal=900.0,
            command=_LARGE),
        Row("the same, peak RSS (GB)", "large", "qwen2_7b_peak_rss_gb", number, goal=8.0, command=_LARGE),
        Row("LLaMA-2-70B, seq 4096, estimated for an H100 SXM: wall time", "large", "llama2_70b_s", seconds,
            goal=120.0, command=_LARGE),
        Row("the same, peak RSS (GB)", "large", "llama2_70b_peak_rss_gb", number, goal=4.0, command=_LARGE),
    ],
    "calibration": [
        Row("cross-split prediction after one calibration, median |measured ÷ predicted − 1|", "calibration",
            "cross_median", goal=0.10, command=_CAL),
        Row("the same, worst", "calibration", "cross_worst", goal=0.20, command=_CAL),
        Row("the same without the fitted crossing delay (the link prices the crossings), median",
            "calibration", "cross_no_fit_median", goal=0.10, command=_CAL),
        Row("the same without the fitted delay, worst", "calibration", "cross_no_fit_worst", goal=0.20,
            command=_CAL),
        Row("the calibrating split run again (same plan), median |error|", "calibration", "same_median",
            command=_CAL),
        Row("the same plan, worst", "calibration", "same_worst", command=_CAL),
        Row("the host's fixed-work floor beside those runs, median |x ÷ median − 1|", "calibration",
            "floor_median", command=_CAL),
        Row("the fixed-work floor, worst", "calibration", "floor_worst", command=_CAL),
    ],
}

BLOCK = re.compile(r"(<!-- begin: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- end: (?P=name) -->)", re.S)


def regenerate(doc: Path = DOC, directory: Path = RESULTS,
               tables: Mapping[str, Sequence[Row] | None] = TABLES) -> str:
    """Rewrite every generated table of ``doc`` from the records in ``directory``, and return the text. A
    block this generator does not know, or a table it knows missing from the document, is refused (the
    document and :data:`TABLES` are kept in step)."""
    records = load_records(directory)
    text = doc.read_text(encoding="utf-8")
    names = [m.group("name") for m in BLOCK.finditer(text)]
    unknown, missing = sorted(set(names) - set(tables)), sorted(set(tables) - set(names))
    if unknown or missing:
        raise RecordError(f"{doc.name}'s generated blocks and the generator's tables differ: blocks "
                          f"{unknown} have no table, tables {missing} have no block; add the markers or the "
                          "table in benchmarks/results.py")

    def body(m: re.Match[str]) -> str:
        rows = tables[m.group("name")]
        generated = runs_table(records) if rows is None else table(rows, records)
        return f"{m.group(1)}{generated}\n{m.group(4)}"

    out = BLOCK.sub(body, text)
    fd, tmp = tempfile.mkstemp(dir=doc.parent, suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(out)
    os.replace(tmp, doc)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--regenerate", action="store_true",
                        help="rewrite docs/accuracy.md's generated tables from benchmarks/results/")
    args = parser.parse_args(argv)
    if args.regenerate:
        regenerate()
        print(f"regenerated {DOC.relative_to(ROOT)} from {len(load_records())} records in "
              f"{RESULTS.relative_to(ROOT)}/")
    else:
        parser.print_help()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
