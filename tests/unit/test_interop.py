"""stageplan.formats.interop: the peers' split formats (Megatron's layout, torchtitan's module FQNs,
DeepSpeed, split_spec) read back into boundaries, each refusal one rule, and every export scored again gives
its split."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import assert_one_line_error, run_cli

from stageplan import Profile, StageplanError
from stageplan.formats.interop import (
    boundaries_from_megatron,
    boundaries_from_module_fqns,
    boundaries_from_split_spec,
    expand_megatron_layout,
)
from stageplan.formats.plan import Plan
from stageplan.planning.planner import plan

from .test_planner import make_profile, quiet_plan

ROOT = Path(__file__).resolve().parents[2]


GPT = ROOT / "profiles" / "cpu" / "gpt-12l-v16k.json"  # tok_emb+pos_emb, blocks.0..11, ln_f+head


E, t, L, m = "E", "t", "L", "m"


@pytest.mark.parametrize(
    ("layout", "stages"),
    [
        # the case the old reader got wrong (2 + 6 layers)
        ("E,t*4|t*4,L", [[E, t, t, t, t], [t, t, t, t, L]]),
        ("Ettt|ttttL", [[E, t, t, t], [t, t, t, t, L]]),
        ("Et*3|(tt|)*2,tL", [[E, t, t, t], [t, t], [t, t], [t, L]]),
        # Megatron-LM's DeepSeek-V3 example: 32 stages
        ("Et*3|(tt|)*29,m|L", [[E, t, t, t], *[[t, t]] * 29, [m], [L]]),
        ("(t*2|)*2", [[t, t], [t, t], []]),  # a group may end a stage; Megatron allows the empty last stage
        ("((t|)*2t)*2", [[t], [t], [t, t], [t], [t]]),  # nested groups (a superset of Megatron's reader)
        ("E, t t | t, L", [[E, t, t], [t, L]]),  # commas and spaces are cosmetic
        ("t*12|t*0t", [[t] * 12, [t]]),  # counts of several digits, and *0
        ("E||L", [[E], [], [L]]),
    ],
)
def test_megatron_layouts_expand_as_written_out_by_hand(layout: str, stages: list[list[str]]) -> None:
    assert expand_megatron_layout(layout) == stages


def test_megatron_boundaries_count_repeats() -> None:
    assert boundaries_from_megatron("E,t*4|t*4,L") == (0, 5, 10)
    assert boundaries_from_megatron("Et*3|(tt|)*2,tL") == (0, 4, 6, 8, 10)
    assert boundaries_from_megatron("(Et|)t*3|(t|)*2L") == (0, 2, 5, 6, 7, 8)
    # a count is read as a number, leading zeros and all (int() alone refuses past 4300 digits)
    assert boundaries_from_megatron("E,t*" + "0" * 5000 + "4|t*04,L") == (0, 5, 10)


@pytest.mark.parametrize(
    ("layout", "pattern"),
    [
        ("E(t|t", r"cannot read Megatron layout 'E\(t\|t': '\(' without '\)' \(at character 5"),
        ("Et)|tL", r"'\)' without '\('"),
        ("Et*|tL", r"'\*' must be followed by a count"),
        ("E*2t|tL", None),  # repeats the embedding: readable, refused later (two E)
        ("*2t", r"'\*n' must follow a symbol or a parenthesised group"),
        ("Et|*2tL", r"'\*n' must follow a symbol or a parenthesised group, not '\|'"),
        ("Et|()*2L", r"empty group '\(\)'"),
        ("Ext|tL", r"unknown symbol 'x' \(at character 1 of 'Ext\|tL'\); write symbols E, t, m, L"),
        ("Et|m|tL",
         r"holds 'm', a multi-token-prediction \(MTP\) layer; a stageplan profile has no MTP layer"),
        ("Et||ttL",
         r"has 3 stages and stage 1 is empty; Megatron allows empty stages, a stageplan split needs"),
    ],
)
def test_megatron_layouts_refused_with_the_rule(layout: str, pattern: str | None) -> None:
    if pattern is None:
        assert expand_megatron_layout(layout) == [[E, E, t], [t, L]]
        return
    with pytest.raises(StageplanError, match=pattern):
        boundaries_from_megatron(layout)


def test_megatron_symbols_map_onto_the_profile() -> None:
    names = ["tok_emb+pos_emb", "blocks.0", "blocks.1", "blocks.2", "ln_f+head"]
    named = names[1:-1]
    assert boundaries_from_megatron("Et*2|tL", names, named) == (0, 3, 5)
    with pytest.raises(StageplanError, match=r"Megatron layout 'Et\*4\|tL' has 1 E, 5 t, 1 L \(7 layers\) "
                                             r"but the profile has 1 E, 3 t, 1 L \(5 layers: E = "
                                             r"'tok_emb\+pos_emb', t = each named block, L = 'ln_f\+head'\); "
                                             r"write a layout with 1 E, 3 t, 1 L"):
        boundaries_from_megatron("Et*4|tL", names, named)
    with pytest.raises(StageplanError, match=r"has 't' at layer 0 where the profile has E "
                                             r"\('tok_emb\+pos_emb'\); E comes first, L last, t in between"):
        boundaries_from_megatron("tE|ttL", names, named)
    with pytest.raises(StageplanError, match=r"has 2 t \(2 layers\) but the profile has 1 E, 3 t, 1 L"):
        boundaries_from_megatron("t|t", names, named)
    odd = ["a", "b", "c"]  # nothing named: every layer is a t
    assert boundaries_from_megatron("t|tt", odd, odd) == (0, 1, 3)
    with pytest.raises(StageplanError, match=r"layer 1 of the profile \('mid'\) is neither the first layer, "
                                             r"the last layer nor a named block"):
        boundaries_from_megatron("E|tL", ["emb", "mid", "x", "head"], ["x"])


NAMES = ["tok_emb+pos_emb", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "ln_f+head"]


def test_module_fqns_name_layers_or_modules_inside_grouped_layers() -> None:
    assert boundaries_from_module_fqns([["tok_emb", "pos_emb", "blocks.0"], ["blocks.1", "blocks.2",
                                                                             "blocks.3", "ln_f",
                                                                             "head"]], NAMES) == (0, 2, 6)
    # the grouped name itself, and any order inside a part
    assert boundaries_from_module_fqns(
        [["blocks.0", "tok_emb+pos_emb"], ["blocks.1"], ["ln_f+head", "blocks.3", "blocks.2"]], NAMES
    ) == (0, 2, 3, 6)


@pytest.mark.parametrize(
    ("parts", "pattern"),
    [
        ([["tok_emb", "pos_emb", "layers.0"]], r"part 0 names 'layers.0', which is no layer of this profile "
                                               r"\(its layers are 'tok_emb\+pos_emb', 'blocks.0', "
                                               r"'blocks.1', 'blocks.2' and 2 more\); use the profile's "
                                               r"layer FQNs"),
        ([["tok_emb", "pos_emb", "blocks.0", "blocks.1"],
          ["blocks.1", "blocks.2", "blocks.3", "ln_f", "head"]],
         r"'blocks.1' is listed in part 0 and in part 1; each module belongs to exactly one part"),
        ([["tok_emb", "pos_emb", "blocks.0"], [], ["blocks.1", "blocks.2", "blocks.3", "ln_f+head"]],
         r"part 1 of the module FQNs is empty; every stage needs at least one layer"),
        ([["tok_emb", "blocks.0"], ["pos_emb", "blocks.1", "blocks.2", "blocks.3", "ln_f+head"]],
         r"'tok_emb\+pos_emb' was profiled as one layer but its modules sit in parts 0, 1; put them in one "
         r"part"),
        ([["tok_emb+pos_emb", "blocks.0", "blocks.2"], ["blocks.1", "blocks.3", "ln_f+head"]],
         r"part 0 holds layers 0..3 but not 'blocks.1'; a stage is one contiguous run of layers"),
        ([["blocks.0", "blocks.1"], ["tok_emb+pos_emb", "blocks.2", "blocks.3", "ln_f+head"]],
         r"part 1 starts at layer 0 \('tok_emb\+pos_emb'\), before part 0 ends \(layer 2\); parts follow the "
         r"model's order"),
        ([["tok_emb+pos_emb", "blocks.0"], ["blocks.2", "blocks.3", "ln_f+head"]],
         r"'blocks.1' is in no part; every module of the profile must be in exactly one part"),
        ([["tok_emb+pos_emb", "blocks.0"], ["blocks.1", "blocks.2", "blocks.3"]],
         r"'ln_f\+head' is in no part"),
        ([["tok_emb", "blocks.0"], ["blocks.1", "blocks.2", "blocks.3", "ln_f", "head"]],
         r"'pos_emb' is in no part"),
        ("blocks.0", r"must be a list of lists of module names \(torchtitan's module_fqns_per_model_part\)"),
        ([[0, 1]], r"must be a list of lists of module names"),
    ],
)
def test_module_fqns_refused_one_rule_each(parts, pattern: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(StageplanError, match=pattern):
        boundaries_from_module_fqns(parts, NAMES)


@pytest.mark.parametrize(("p", "schedule", "v"), [(2, "1F1B", 1), (4, "GPipe", 1), (2, "Interleaved1F1B", 2)])
def test_exports_scored_again_give_the_same_boundaries(p: int, schedule: str, v: int) -> None:
    prof = Profile.load(GPT)
    pl = quiet_plan(prof, p, num_microbatches=2 * p, schedule=schedule, virtual_stages=v)
    kw = dict(num_microbatches=2 * p, schedule=schedule, virtual_stages=v)
    assert quiet_plan(prof, p, megatron_layout=pl.export("megatron"), **kw).boundaries == pl.boundaries
    assert quiet_plan(prof, p, fqns=pl.export("torchtitan"), **kw).boundaries == pl.boundaries
    if v == 1:
        assert quiet_plan(prof, p, boundaries=pl.export("deepspeed"), **kw).boundaries == pl.boundaries
    else:  # DeepSpeed cannot place two chunks on a rank; the plan's own boundaries score the same split
        with pytest.raises(StageplanError, match=r"deepspeed places one stage on each rank"):
            pl.export("deepspeed")
        assert quiet_plan(prof, p, boundaries=list(pl.boundaries), **kw).boundaries == pl.boundaries
    scored = quiet_plan(prof, p, megatron_layout=pl.export("megatron"), **kw)
    assert scored.versus_optimal["optimal_boundaries"] == list(pl.boundaries)
    assert scored.versus_optimal["bottleneck_ratio"] == 1.0


def test_cli_round_trips_each_export(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = [str(GPT), "--stages", "2", "--microbatches", "4"]
    # E, blocks 0..11, L: cut inside the blocks
    cut = quiet_plan(Profile.load(GPT), 2, num_microbatches=4).boundaries[1]
    assert 1 < cut < 13
    code, layout, _ = run_cli(["plan", *base, "--export", "megatron"], capsys)
    assert code == 0 and layout.strip() == "E" + "t" * (cut - 1) + "|" + "t" * (13 - cut) + "L"
    code, fqns, _ = run_cli(["plan", *base, "--export", "torchtitan"], capsys)
    (tmp_path / "fqns.json").write_text(fqns)
    code, cuts, _ = run_cli(["plan", *base, "--export", "deepspeed"], capsys)
    for flag, value in (("--megatron-layout", layout.strip()), ("--fqns", str(tmp_path / "fqns.json")),
                        ("--boundaries", ",".join(map(str, json.loads(cuts))))):
        code, out, _ = run_cli(["plan", *base, flag, value, "-o", str(tmp_path / "given.json")], capsys)
        assert code == 0, flag
        assert f"boundaries [0, {cut}, 14]" in out and "= 1.000x; predicted step" in out
        assert Plan.load(tmp_path / "given.json").boundaries == (0, cut, 14)
    # torchtitan's own config key holding the list is read too
    (tmp_path / "job.json").write_text(json.dumps({"module_fqns_per_model_part": json.loads(fqns)}))
    code, out, _ = run_cli(["plan", *base, "--fqns", str(tmp_path / "job.json")], capsys)
    assert code == 0 and f"boundaries [0, {cut}, 14]" in out


@pytest.mark.parametrize(
    ("args", "pattern"),
    [
        (["--megatron-layout", "E,t*4|t*4,L"],
         r"has 1 E, 8 t, 1 L \(10 layers\) but the profile has 1 E, 12 t, 1 L"),
        (["--megatron-layout", "E(t*12|L"], r"cannot read Megatron layout"),
        (["--megatron-layout", "Et*12|m|L"], r"holds 'm', a multi-token-prediction \(MTP\) layer"),
        (["--megatron-layout", "Et*12L"], r"the Megatron layout gives 1 stage but 2 ranks x 1 chunks need 2"),
        (["--fqns", "missing.json"], r"FQN file 'missing.json' does not exist"),
        (["--fqns", "BAD"], r"is not valid JSON"),
        (["--fqns", "UNKNOWN"], r"part 0 names 'layers.0', which is no layer of this profile"),
        (["--boundaries", "0,7,14", "--megatron-layout", "Et*6|t*6L"], r"got boundaries and megatron_layout"),
        (["--boundaries", "0,7,14", "--method", "optimal"],
         r"method 'optimal' chooses a split but boundaries gives one"),
        # a value that starts with a minus is the flag's value, refused by its own rule (argparse alone:
        # 'expected one argument')
        (["--boundaries", "-1,7,14"],
         r"boundaries \[-1, 7, 14\] must be 3 increasing cut points from 0 to 14"),
        (["--device-speeds", "-1,1"], r"device 0 speed must be between 1e-06 and 1e\+06, got -1.0"),
        (["--boundaries", "-x"], r"argument --boundaries: expected one argument"),
        # abbreviated
        (["--bound", "-1,7,14"], r"boundaries \[-1, 7, 14\] must be 3 increasing cut points from 0 to 14"),
        (["--device-s", "-1,1"], r"device 0 speed must be between 1e-06 and 1e\+06, got -1.0"),
    ],
)
def test_cli_refuses_bad_splits_in_one_line(args: list[str], pattern: str, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "bad.json").write_text("[[")
    (tmp_path / "unknown.json").write_text(json.dumps([["layers.0"], ["ln_f+head"]]))
    args = [str(tmp_path / "bad.json") if a == "BAD" else str(tmp_path / "unknown.json") if a == "UNKNOWN"
            else a for a in args]
    code, _, err = run_cli(["plan", str(GPT), "--stages", "2", "--microbatches", "4", *args], capsys)
    assert_one_line_error(code, err, pattern)


def test_an_interleaved_plan_exports_where_the_tool_can_place_it(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Megatron's virtual stages go round-robin, as Interleaved1F1B places them; torchtitan's parts and
    torch's split points leave the placement to the schedule."""
    pl = plan(make_profile([1, 2, 3, 4, 5, 6]), 2, num_microbatches=4, schedule="Interleaved1F1B",
              virtual_stages=2)
    assert [st.rank for st in pl.stages] == [0, 1, 0, 1]
    assert boundaries_from_megatron(pl.export("megatron")) == pl.boundaries
    assert boundaries_from_module_fqns(pl.export("torchtitan"), pl.layer_names) == pl.boundaries
    assert boundaries_from_split_spec(pl.export("split-spec"), pl.layer_names) == pl.boundaries


def test_a_megatron_layout_is_scored_only_where_the_schedule_places_stages_as_megatron_does() -> None:
    """Megatron runs virtual stage s on rank s mod p. ZBVZeroBubble places them V-shaped (0, 1, 1, 0), so the
    layout scored there (it was, silently, at 0.97x the bottleneck of the round-robin placement) is a split
    Megatron never runs; the same layout under Interleaved1F1B scores on Megatron's own placement, and
    --boundaries still scores the V split."""
    from stageplan.formats.schedule import stage_ranks

    prof = make_profile([1, 2, 3, 4, 5, 6, 7, 8])
    layout = "E,t|t*2|t*2|t,L"
    with pytest.raises(StageplanError, match=r"Megatron places virtual stages round-robin .* ZBVZeroBubble "
                                             r"places them otherwise \(ranks \[0, 1, 1, 0\]\)"):
        plan(prof, 2, num_microbatches=4, schedule="ZBVZeroBubble", virtual_stages=2, megatron_layout=layout)
    assert list(stage_ranks("Interleaved1F1B", 2, 2)) == [0, 1, 0, 1]
    given = plan(prof, 2, num_microbatches=4, schedule="Interleaved1F1B", virtual_stages=2,
                 megatron_layout=layout)
    assert given.boundaries == (0, 2, 4, 6, 8) and [st.rank for st in given.stages] == [0, 1, 0, 1]
    v = plan(prof, 2, num_microbatches=4, schedule="ZBVZeroBubble", virtual_stages=2,
             boundaries=[0, 2, 4, 6, 8])
    assert [st.rank for st in v.stages] == [0, 1, 1, 0]
