"""Progress for long commands: a tqdm bar on a terminal, plain throttled lines elsewhere (no torch).

A log file or a pipe gets whole lines (never carriage returns): at most one every ``interval_s`` seconds,
plus the last one, never the same line twice, each with the time so far and an estimate of the time left.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TextIO


class Progress:
    """``update(k)`` moves to k of ``total``; ``close()`` ends it. Disabled: does nothing."""

    def __init__(self, total: int, desc: str, *, enabled: bool = True, stream: TextIO | None = None,
                 interval_s: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.total, self.desc, self.enabled = total, desc, enabled
        self.stream = stream if stream is not None else sys.stderr
        self.interval_s = interval_s
        self._clock = clock
        self._start = clock()
        self._bar: Any = None
        self._last_line = -float("inf")
        self._last_text: str | None = None
        self._done = 0
        self._part = 0.0
        self._postfix = ""
        if enabled and _isatty(self.stream):
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, file=self.stream, leave=False, dynamic_ncols=True,
                             bar_format="{desc}: {n_fmt}/{total_fmt} |{bar}| {elapsed}<{remaining} {postfix}")

    def update(self, done: int, postfix: str = "", *, part: float = 0.0) -> None:
        """Set progress to ``done`` items (clamped to total) with a short status text; ``part`` (0 to 1) is
        how much of the next item is done, for the estimate of the time left while one item takes minutes."""
        if not self.enabled:
            return
        done = max(0, min(done, self.total))
        self._postfix = postfix
        self._part = min(max(part, 0.0), 1.0) if done < self.total else 0.0
        if self._bar is not None:
            self._bar.update(done - self._done)
            if postfix:
                self._bar.set_postfix_str(postfix, refresh=True)
        elif self._clock() - self._last_line >= self.interval_s or done == self.total:
            self._line(done)
        self._done = done

    def _line(self, done: int) -> None:
        tail = f" {self._postfix}" if self._postfix else ""
        text = f"{self.desc}: {done}/{self.total}{tail}"
        if text == self._last_text:  # a round past the total, or a close where it stopped: said already
            return
        now = self._clock()
        self._last_line, self._last_text = now, text
        elapsed = now - self._start
        share = (done + self._part) / self.total if self.total else 1.0
        left = elapsed / share - elapsed if share > 0 and elapsed > 0 else None
        eta = "" if left is None or done >= self.total else f", about {duration(left)} left"
        self.stream.write(f"{text} ({duration(elapsed)} so far{eta})\n")
        self.stream.flush()

    def within(self, done: int, label: str, rounds: int) -> Callable[[int], None]:
        """A callback for the rounds of the item after ``done``: round r of ``rounds`` reads "LABEL round
        r/ROUNDS" and counts r / (rounds + 1) of the item done (the last share is what follows the rounds)."""
        def on_round(r: int) -> None:
            r = min(r, rounds)  # rounds past the count spread a profile over --min-time
            self.update(done, f"{label} round {r}/{rounds}", part=r / (rounds + 1))
        return on_round

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self.enabled and self._done < self.total and self._done > 0:
            self._line(self._done)


def duration(seconds: float) -> str:
    """A span as a person reads it in a log line.

    >>> duration(7.4), duration(365), duration(7260)
    ('7 s', '6 min 05 s', '2 h 01 min')
    """
    s = round(seconds)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


def _isatty(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False
