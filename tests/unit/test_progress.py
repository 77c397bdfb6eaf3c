"""stageplan._progress: off a terminal, progress is plain throttled lines."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import run_cli


def test_profile_progress_is_plain_lines_off_a_terminal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run_cli(["profile", "workloads:mlp", "--warmup", "1", "--repeats", "2", "-o",
                            str(tmp_path / "p.json")],
                           capsys)
    assert code == 0
    assert "profiling 8 layers: 3/3" in err and "\r" not in err


class _Clock:
    """A clock the test moves: the oracle for every elapsed and estimated time printed."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_off_a_terminal_lines_are_throttled_and_the_last_is_always_written() -> None:
    import io

    from stageplan._progress import Progress

    out = io.StringIO()  # not a terminal: plain lines, at most one an hour here, plus the last
    clock = _Clock()
    progress = Progress(5, "profiling", stream=out, interval_s=3600.0, clock=clock)
    for k in range(1, 5):
        clock.now += 10.0
        progress.update(k, f"layer {k}")
    clock.now += 10.0
    progress.update(5)
    progress.close()
    # 1 of 5 in 10 s: 40 s left; the last line has nothing left to estimate
    assert out.getvalue() == ("profiling: 1/5 layer 1 (10 s so far, about 40 s left)\n"
                              "profiling: 5/5 (50 s so far)\n")
    stopped = io.StringIO()  # ended early: close does not say again what was said
    progress = Progress(5, "profiling", stream=stopped, interval_s=3600.0, clock=_Clock())
    progress.update(2)
    progress.close()
    assert stopped.getvalue() == "profiling: 2/5 (0 s so far)\n"
    quiet = io.StringIO()
    progress = Progress(5, "profiling", enabled=False, stream=quiet)
    progress.update(5)
    progress.close()
    assert quiet.getvalue() == ""


def test_each_line_is_printed_once_and_rounds_inside_an_item_show_progress_with_an_estimate() -> None:
    """The trial's log: rounds past the count (--min-time) repeated "5/5 measuring" six times. And a
    LLaMA-2-7B block took 6 minutes between two lines: the rounds inside an item give lines, and the
    estimate counts the share of the item done."""
    import io

    from stageplan._progress import Progress

    out = io.StringIO()
    clock = _Clock()
    progress = Progress(5, "profiling", stream=out, interval_s=0.0, clock=clock)
    for r in range(1, 12):  # 5 rounds counted, 6 more to span --min-time
        clock.now += 1.0
        progress.update(r, "measuring")
    lines = out.getvalue().splitlines()
    assert [x.split(" (")[0] for x in lines] == [f"profiling: {k}/5 measuring" for k in range(1, 6)]

    out = io.StringIO()
    clock = _Clock()
    progress = Progress(4, "profiling 4 layers", stream=out, interval_s=60.0, clock=clock)
    progress.update(1, "block.1")
    on_round = progress.within(1, "block.1", 3)
    for r in (1, 2, 3, 4):  # a 4th round past the count reads as the 3rd
        clock.now += 60.0
        on_round(r)
    # round r of 3 counts r/4 of item 2: at 60 s, 1.25 of 4 items are done, so 60 * 4 / 1.25 - 60 = 132 s
    # are left; at 120 s, 120 * 4 / 1.5 - 120 = 200 s; at 180 s, 180 * 4 / 1.75 - 180 = 231.4 s; the 4th
    # round reads as the 3rd and is not printed again
    assert out.getvalue().splitlines() == [
        "profiling 4 layers: 1/4 block.1 (0 s so far)",
        "profiling 4 layers: 1/4 block.1 round 1/3 (1 min 00 s so far, about 2 min 12 s left)",
        "profiling 4 layers: 1/4 block.1 round 2/3 (2 min 00 s so far, about 3 min 20 s left)",
        "profiling 4 layers: 1/4 block.1 round 3/3 (3 min 00 s so far, about 3 min 51 s left)",
    ]
