"""The one error family of stageplan: every message states the rule, the values and the remedy.

This module imports nothing (it is a leaf), so every other module, the pure solver included,
may raise these errors.
"""

from __future__ import annotations


class StageplanError(ValueError):
    """Bad input or an impossible request. The CLI prints it as one line and exits 2."""


class InfeasiblePlanError(StageplanError):
    """No partition fits the memory limits.

    ``min_memory_limit_bytes`` is the smallest uniform limit that would admit a plan, when it can be
    computed (``None`` when a single layer exceeds every device).
    """

    def __init__(self, message: str, *, min_memory_limit_bytes: float | None = None) -> None:
        super().__init__(message)
        self.min_memory_limit_bytes = min_memory_limit_bytes


class SchemaError(StageplanError):
    """A stored file (profile, plan, run report) has an unknown schema or malformed content."""


class WorkloadError(StageplanError):
    """A model/workload cannot be built, cut into layers or profiled as asked."""


class PlanNote(UserWarning):
    """A plan's note that an API caller should not miss (a bubble from too few microbatches). The plan keeps
    it in ``notes``; the CLI's plan report prints it there, so the CLI does not warn it a second time."""


class RunError(RuntimeError):
    """A multi-process run failed on some rank (not a user-input problem: the CLI exits 1)."""

    def __init__(self, message: str, *, rank: int | None = None, log_path: str | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.log_path = log_path


class RunInterrupted(KeyboardInterrupt):
    """A run ended early by Ctrl-C (SIGINT to the launcher). The ranks finished their current step and stopped
    together; ``report`` is the RunReport of the steps measured until then, marked partial in
    ``report.meta["partial"]`` (None when no measured step had finished), and ``output`` the file it was
    written to (None when it was not written). A KeyboardInterrupt, so code that catches Ctrl-C still does."""

    def __init__(self, message: str, *, report: object = None, output: str | None = None) -> None:
        super().__init__(message)
        self.report = report
        self.output = output
