"""stageplan.profiling.assemble: a layer's figures from its timed rounds (medians and spreads), and the
parameters a piece holds, a tied one counted once."""

from __future__ import annotations

from torch import nn

from stageplan.profiling.assemble import make_figures, param_totals


def test_figures_are_the_medians_and_spreads_of_the_rounds() -> None:
    # forward 1, 2, 3 s: median 2, inclusive quartiles 1.5 and
    # 2.5; backward 4..7 s: median 5.5, quartiles 4.75, 6.25
    fig = make_figures([[3.0, 1.0, 2.0], [5.0, 4.0, 6.0, 7.0], [9.0]], 10, None)
    assert (fig.forward_s, fig.forward_iqr_s) == (2.0, 1.0)
    assert (fig.backward_s, fig.backward_iqr_s) == (5.5, 1.5)
    assert fig.backward_accumulate_s == 9.0 and fig.activation_bytes == 10 and fig.peak_bytes is None


def test_a_parameter_tied_inside_a_piece_is_counted_once() -> None:
    first, last = nn.Linear(4, 4), nn.Linear(4, 4)
    last.weight = first.weight
    # the shared 4x4 weight once and two biases of 4: 24 float32 parameters, 96 bytes
    assert param_totals(nn.Sequential(first, nn.ReLU(), last)) == (96, 24)
