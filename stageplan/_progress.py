"""Progress for long commands: a tqdm bar on a terminal, plain throttled lines elsewhere (no torch).

A log file or a pipe gets whole lines (never carriage returns): at most one every ``interval_s`` seconds,
plus the last one.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO


class Progress:
    """``update(k)`` moves to k of ``total``; ``close()`` ends it. Disabled: does nothing."""

    def __init__(self, total: int, desc: str, *, enabled: bool = True, stream: TextIO | None = None,
                 interval_s: float = 5.0) -> None:
        self.total, self.desc, self.enabled = total, desc, enabled
        self.stream = stream if stream is not None else sys.stderr
        self.interval_s = interval_s
        self._bar: Any = None
        self._last_line = -float("inf")
        self._done = 0
        self._postfix = ""
        if enabled and _isatty(self.stream):
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, file=self.stream, leave=False, dynamic_ncols=True,
                             bar_format="{desc}: {n_fmt}/{total_fmt} |{bar}| {elapsed}<{remaining} {postfix}")

    def update(self, done: int, postfix: str = "") -> None:
        """Set progress to ``done`` items (clamped to total) with a short status text."""
        if not self.enabled:
            return
        done = max(0, min(done, self.total))
        self._postfix = postfix
        if self._bar is not None:
            self._bar.update(done - self._done)
            if postfix:
                self._bar.set_postfix_str(postfix, refresh=True)
        elif time.monotonic() - self._last_line >= self.interval_s or done == self.total:
            self._line(done)
        self._done = done

    def _line(self, done: int) -> None:
        self._last_line = time.monotonic()
        tail = f" {self._postfix}" if self._postfix else ""
        self.stream.write(f"{self.desc}: {done}/{self.total}{tail}\n")
        self.stream.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self.enabled and self._done < self.total and self._done > 0:
            self._line(self._done)


def _isatty(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False
