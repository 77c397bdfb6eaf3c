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
    assert len(pl.notes) >= 3 and any(len(n) > 2 * NOTE_WIDTH for n in pl.notes)
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
    """The 70B estimate on 16 stages under a 49 GiB limit: every row over the limit says NO and by how much
    (its fullest rank less the limit, from the plan's own rank memory), the rows that fit say yes; Megatron's
    default (5 blocks a stage, E first, L last) is a row of its own, equal to the optimal split here; every
    row is named in a line of its own and the account_for_* variants say why they give none."""
    from stageplan.cli import main

    opts = dict(num_microbatches=64, recompute=True, memory_limit="49GiB")
    assert main(["plan", str(LLAMA_70B), "--stages", "16", "--microbatches", "64", "--recompute",
                 "--memory-limit", "49GiB", "--compare"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines()
            if line.split()[1:2] == ["0"] and line[0].isalpha()}  # the comparison's rows
    assert set(rows) == {"optimal", "uniform", "parameters", "megatron", "torchtitan"}
    limit = 49 * 2**30
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
