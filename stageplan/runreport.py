"""RunReport: what an executed plan measured, side by side with what it predicted (no torch)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from stageplan._io import check_schema, read_json, write_json_atomic
from stageplan.errors import SchemaError

if TYPE_CHECKING:
    import pandas as pd

RUN_SCHEMA = "stageplan.run/1"


@dataclass(frozen=True)
class RunReport:
    """Medians over the measured steps (after warm-up), with IQR spreads.

    ``stages`` holds one entry per pipeline rank: its stage indices, predicted and measured compute seconds
    per microbatch (forward, backward), idle seconds per step, and predicted and measured peak activation bytes.
    """

    measured_step_s: float
    predicted_step_s: float
    measured_step_iqr_s: float
    samples_per_s: float
    measured_bubble_fraction: float
    predicted_bubble_fraction: float
    stages: tuple[dict[str, Any], ...]
    losses: tuple[float, ...]
    plan: dict[str, Any]
    options: dict[str, Any]
    meta: dict[str, Any] = field(default_factory=dict)
    check: dict[str, Any] | None = None
    timeline: tuple[dict[str, Any], ...] = ()

    @property
    def step_ratio(self) -> float:
        """measured / predicted step time."""
        return self.measured_step_s / self.predicted_step_s if self.predicted_step_s else float("nan")

    def to_pandas(self) -> pd.DataFrame:
        import pandas as pd

        return pd.DataFrame(list(self.stages))

    def to_json(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["stages"] = list(self.stages)
        d["losses"] = list(self.losses)
        d["timeline"] = list(self.timeline)
        return {"schema": RUN_SCHEMA, **d}

    @classmethod
    def from_json(cls, data: dict[str, Any], *, source: str = "run report") -> RunReport:
        check_schema(data, RUN_SCHEMA, source)
        try:
            kwargs = {f.name: data[f.name] for f in fields(cls) if f.name in data}
            kwargs["stages"] = tuple(data["stages"])
            kwargs["losses"] = tuple(data.get("losses", ()))
            kwargs["timeline"] = tuple(data.get("timeline", ()))
            return cls(**kwargs)
        except (KeyError, TypeError) as exc:
            raise SchemaError(f"{source} is missing or mangles field {exc}; rerun stageplan run") from exc

    def save(self, path: str | os.PathLike[str]) -> None:
        write_json_atomic(path, self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> RunReport:
        return cls.from_json(read_json(path, "run report"), source=f"run report {str(path)!r}")
