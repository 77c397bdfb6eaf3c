"""stageplan.report: the run table names each rank's CPUs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from stageplan.planning.planner import plan
from stageplan.report import run_table

from .test_calibration import _profile, _report


@pytest.mark.parametrize(("placed", "line"), [
    ([[0, 1], [2, 3]], "CPUs per rank: rank 0 on 0,1; rank 1 on 2,3"),
    ([[0], None], "CPUs per rank: rank 0 on 0; rank 1 not pinned"),  # one rank could not set its affinity
    ([None, None], "CPUs per rank: not pinned (the OS places the ranks)"),
])
def test_run_table_names_each_ranks_cpus(placed: list, line: str) -> None:  # type: ignore[type-arg]
    pl = plan(_profile(), 2, num_microbatches=4, boundaries=[0, 2, 5], optimizer="none")
    report = dataclasses.replace(_report(pl), meta={"cpus_per_rank": placed})
    assert line in run_table(report).splitlines()


def test_a_report_from_before_pinning_prints_no_placement_line() -> None:
    pl = plan(_profile(), 2, num_microbatches=4, boundaries=[0, 2, 5], optimizer="none")
    assert "CPUs per rank" not in run_table(_report(pl))


def test_a_big_plans_notes_are_one_line_each_unless_explained() -> None:
    """The 20-stage plan of the LLaMA-2-70B estimate: every note one line (at most "note: " and NOTE_WIDTH
    characters), a closing line says how to see them whole, and explain prints each note as the plan holds
    it."""
    import warnings
    from pathlib import Path

    from stageplan import Profile, plan
    from stageplan.report import NOTE_WIDTH, note_line, plan_table

    prof = Profile.load(Path(__file__).resolve().parents[2] / "profiles" / "estimate"
                        / "llama2-70b-h100-sxm.json")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pl = plan(prof, 20, num_microbatches=40)
    # (an estimate has no note on how to run it here: it is not run here)
    assert len(pl.notes) >= 2 and any(len(n) > 2 * NOTE_WIDTH for n in pl.notes)
    short = [ln for ln in plan_table(pl).splitlines() if ln.startswith("note: ")]
    assert len(short) == len(pl.notes) and all(len(ln) <= len("note: ") + NOTE_WIDTH + 4 for ln in short)
    assert short[0].startswith("note: ESTIMATE: times are analytic") and short[0].endswith(" ...")
    assert plan_table(pl).splitlines()[-1] == "(notes cut to one line: --explain prints them whole)"
    whole = [ln for ln in plan_table(pl, explain=True).splitlines() if ln.startswith("note: ")]
    assert whole == [f"note: {n}" for n in pl.notes]
    assert note_line("a; b") == "a ..." and note_line("x" * 300).endswith("...") and note_line("a b") == "a b"


def test_cli_plan_and_show_take_explain(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from conftest import run_cli

    est = str(Path(__file__).resolve().parents[2] / "profiles" / "estimate" / "llama2-70b-h100-sxm.json")
    code, out, _ = run_cli(["plan", est, "--stages", "20", "--microbatches", "40", "-o",
                            str(tmp_path / "p.json")],
                           capsys)
    assert (
        code == 0 and "--explain prints them whole" in out and "ratios between layers are steadier" not in out
    )
    code, out, _ = run_cli(["show", str(tmp_path / "p.json"), "--explain"], capsys)
    assert code == 0 and "a GPU; ratios between layers are steadier" in out


LLAMA_70B = Path(__file__).resolve().parents[2] / "profiles" / "estimate" / "llama2-70b-h100-sxm.json"


def test_plan_compare_shows_the_peers_defaults_and_marks_what_does_not_fit(
        capsys: pytest.CaptureFixture[str]) -> None:
    """The 70B estimate on 16 stages under a 46 GiB limit: every row over the limit says NO and by how much
    (its fullest rank less the limit, from the plan's own rank memory), the rows that fit say yes; Megatron's
    default (5 blocks a stage, E first, L last) is a row of its own, equal to the optimal split here; every
    row is named in a line of its own and the account_for_* variants say why they give none."""
    from stageplan.cli import main

    opts = dict(num_microbatches=64, recompute=True, memory_limit="46GiB")
    assert main(["plan", str(LLAMA_70B), "--stages", "16", "--microbatches", "64", "--recompute",
                 "--memory-limit", "46GiB", "--compare"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines()
            if line.split()[1:2] == ["0"] and line[0].isalpha()}  # the comparison's rows
    assert set(rows) == {"optimal", "uniform", "parameters", "megatron", "torchtitan"}
    limit = 46 * 2**30
    megatron = (0, 6, *range(11, 77, 5), 82)
    for name, boundaries in (("uniform", None), ("megatron", megatron), ("optimal", None)):
        pl = plan(str(LLAMA_70B), 16, method=None if boundaries else name, boundaries=boundaries, **opts)
        over = max(pl.rank_memory_bytes) - limit
        said = rows[name].split("  ")[-1].strip()
        assert (f"NO, {over / 2**30:.1f} GiB over" if over > 0 else "yes") == said
    assert rows["uniform"].endswith("GiB over") and rows["megatron"].endswith("yes")
    assert " ".join(map(str, megatron)) in rows["megatron"] and rows["megatron"].split()[-6] == "1.000"
    assert "over the memory limit: uniform, torchtitan" in out
    for line in ("uniform: DeepSpeed partition_method='uniform'", "parameters: DeepSpeed",
                 "megatron: Megatron-LM default", "torchtitan: torchtitan default",
                 "megatron+E: not applicable (Megatron needs 80 blocks + E = 81 divisible by 16 stages)",
                 "x optimal = the row's time / the optimal row's"):
        assert any(x.startswith(line) for x in out.splitlines()), line


def test_a_big_plans_summary_says_tokens_memory_in_gib_and_for_an_estimate_mfu() -> None:
    """The 70B estimate on 16 stages, m = 64, recompute, 80 GiB: tokens/s (samples/s x seq_len 4096), the
    fullest rank in GiB against the limit, and TFLOP/s per GPU and MFU from PaLM's model FLOPs a token (6N +
    12 x layers x hidden x seq, the layout search's count: LLaMA-2-70B has 80 layers of hidden 8192) against
    gpus.json's bf16 peak, and HFU with the recomputed forward (8N + 16 x layers x hidden x seq); the note on
    how to run the model here is not printed for an estimate, and is for a measured profile whose batch the
    plan does not make up."""
    import json

    from stageplan import Profile
    from stageplan.report import plan_table

    from .test_planner import make_profile

    prof = Profile.load(LLAMA_70B)
    pl = plan(prof, 16, num_microbatches=64, recompute=True, memory_limit="80GiB")
    lines = plan_table(pl).splitlines()
    tokens = pl.throughput_samples_s * 4096
    assert any(line.endswith(f", {tokens:,.0f} tokens/s (4096 a sample)") for line in lines)
    fullest = max(pl.rank_memory_bytes)
    rank = pl.rank_memory_bytes.index(fullest)
    assert f"memory: fits 80.0 GiB: fullest rank {fullest / 2**30:.1f} GiB (rank {rank})" in lines
    params = sum(x.param_count for x in prof.layers)
    peak = json.loads((LLAMA_70B.parents[2] / "stageplan" / "gpus.json").read_text())["gpus"]["h100-sxm"][
        "peak_flops"]["bf16"]
    attention = 80 * 8192 * 4096
    per_gpu = tokens * (6 * params + 12 * attention) / 16
    hfu = tokens * (8 * params + 16 * attention) / 16 / peak
    assert (f"estimate: {per_gpu / 1e12:.0f} TFLOP/s per GPU, MFU {per_gpu / peak:.1%} of the bf16 peak "
            f"{peak / 1e12:.1f} TFLOP/s, HFU {hfu:.1%} (the recomputed forward counted) (6 x "
            f"{params / 1e9:.1f}e9 parameters + 12 x 80 layers x 8192 hidden x 4096 tokens FLOPs a token)"
            ) in "\n".join(lines)
    assert not any("to run this model" in n for n in pl.notes)  # the estimate's batch is 8, m x 1 is 64
    tight = plan(prof, 16, num_microbatches=64, recompute=True, memory_limit="40GiB", method="uniform")
    assert any(line.startswith("memory: does NOT fit 40.0 GiB: fullest rank") for line in
               plan_table(tight).splitlines())
    measured = plan(make_profile([1, 2, 3, 4]), 2, num_microbatches=8)  # batch 8 of microbatches of 2
    assert any("to run this model plan --microbatches 4" in n for n in measured.notes)
    assert not any(line.startswith("estimate:") for line in plan_table(measured).splitlines())


def test_a_run_report_says_one_thing_a_line_and_its_details_come_with_explain() -> None:
    """The trial's complaint: the idle-split paragraph ("chunk calls after the rank computed nothing ...") and
    other several-rank paragraphs. By default the report names what --explain adds; with it, each section is
    a heading and a line per rank, none of them wider than a heading's sentence."""
    pl = plan(_profile(), 2, num_microbatches=4, boundaries=[0, 2, 5], optimizer="none")
    base = _report(pl)
    ranks = [dict(r, predicted_after_idle_calls=3, measured_after_idle_calls=4.0, after_idle_ratio=1.5,
                  back_to_back_ratio=0.9, after_idle_excess_s=2e-4, predicted_receive_wait_s=1e-3,
                  measured_receive_wait_s=2e-3) for r in base.ranks]
    report = dataclasses.replace(base, ranks=ranks)
    short = run_table(report).splitlines()
    assert not any("after idle" in line or line.startswith("waits on receives") for line in short[:-1])
    assert short[-1] == ("--explain adds: layers inside the schedule, chunk overhead outside the layers, "
                         "waits on receives, calls after idle")
    full = run_table(report, explain=True).splitlines()
    for r in (0, 1):
        assert f"  rank {r} 3 / 4 after idle (calls a step, predicted / measured)" in full
        assert f"  rank {r} after idle x1.500 the planned pace" in full
        assert f"  rank {r} a call after idle took 0.200 ms beyond a back-to-back one's pace" in full
        assert f"  rank {r} predicted 1.000, measured 2.000" in full
    assert max(len(line) for line in full if not line.startswith("  ") and "|" not in line) <= 200


def test_a_partial_run_says_so_under_its_step_line() -> None:
    """A run ended by Ctrl-C keeps its measured steps; its table says how many of those asked, and what it
    skipped to end at once."""
    pl = plan(_profile(), 2, num_microbatches=4, boundaries=[0, 2, 5], optimizer="none")
    whole = run_table(_report(pl)).splitlines()
    assert not any(line.startswith("partial:") for line in whole)
    base = _report(pl)
    report = dataclasses.replace(base, meta={**base.meta, "partial": {
        "reason": "interrupted (Ctrl-C)", "steps_measured": 46, "steps_asked": 50, "skipped": ["check"]}})
    lines = run_table(report).splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("step:"))
    assert lines[at + 1] == "partial: interrupted (Ctrl-C) after 46 of 50 measured steps; skipped: check"


def test_compare_warns_of_a_busy_machine_and_explains_a_reversed_speed_up() -> None:
    """The trial: at load average 3.3, compare printed 0.674x against a predicted 1.127x with no word. The
    table now names every row's baseline, warns, and says why the measured speed-up goes against the
    prediction."""
    from stageplan.host import contention
    from stageplan.report import compare_run_table

    why = contention(num_ranks=2, cpus=2, load_average=3.3, pinned=True)
    row = {"balance_efficiency": 0.9, "peak_memory_bytes": [1.0, 2.0]}
    result = {"methods": {
        "optimal": {**row, "boundaries": [0, 4, 8], "predicted_step_s": 0.1, "measured_step_s": 0.148,
                    "speedup_over_uniform": 0.674, "distorted": why},
        "uniform": {**row, "boundaries": [0, 3, 8], "predicted_step_s": 0.1127, "measured_step_s": 0.1,
                    "speedup_over_uniform": 1.0, "distorted": None}},
        "not_applicable": {"megatron": "Megatron needs 7 blocks = 7 divisible by 2 stages"}}
    lines = compare_run_table(result).splitlines()
    assert f"warning: {why}" in lines and "--no-pin" in str(why)
    assert ("note: the measured 0.674x reverses the predicted 1.127x because the load average was 3.30 on 2 "
            "CPUs") in "\n".join(lines)
    assert "uniform: DeepSpeed partition_method='uniform', equal layers (E and L counted as layers)" in lines
    assert "megatron: not applicable (Megatron needs 7 blocks = 7 divisible by 2 stages)" in lines
    assert any(line.startswith("speed-up vs uniform = uniform's measured step / the row's") for line in lines)
    quiet = {"methods": {k: {**v, "distorted": None} for k, v in result["methods"].items()}}
    said = "\n".join(compare_run_table(quiet).splitlines())
    assert "warning:" not in said and "with the machine quiet" in said
