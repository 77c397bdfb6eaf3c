"""Plan: boundaries plus the evidence behind them; exports to other tools' split formats (no torch)."""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

from stageplan._io import check_schema, read_json, write_json_atomic
from stageplan.errors import SchemaError, StageplanError

if TYPE_CHECKING:
    import pandas as pd

    from stageplan.schedules import Simulation

PLAN_SCHEMA = "stageplan.plan/2"
# plan/1 called the cost options "options"; plan/2 calls them "cost_options". Both load.
_OLD_PLAN_SCHEMA = "stageplan.plan/1"
EXPORTS = ("split-spec", "torchtitan", "megatron", "deepspeed", "torchgpipe")


@dataclass(frozen=True)
class StagePlan:
    """One stage (chunk) of a plan: its layers, seconds per microbatch and bytes by kind."""

    index: int
    rank: int
    layers: tuple[str, ...]
    first_layer: int
    end_layer: int  # exclusive
    forward_s: float
    backward_s: float
    comm_s: float  # both directions across the boundary after this stage
    time_s: float
    inflight: int
    memory: dict[str, float]
    memory_limit_bytes: float | None = None


@dataclass(frozen=True)
class Plan:
    """Stage boundaries ``(0, b1, ..., L)`` with the evidence behind them.

    Invariants (tested): stages are contiguous, non-empty and cover every layer; ``bottleneck_s`` equals the
    largest stage time (per rank for interleaved schedules, where a rank runs several stages).
    """

    boundaries: tuple[int, ...]
    layer_names: tuple[str, ...]
    stages: tuple[StagePlan, ...]
    bottleneck_s: float
    lower_bound_s: float
    balance_efficiency: float
    predicted_step_s: float
    bubble_fraction: float
    throughput_samples_s: float
    rank_time_s: tuple[float, ...]
    rank_memory_bytes: tuple[float, ...]
    rank_peak_activation_bytes: tuple[float, ...]
    cost_options: dict[str, Any]
    profile_digest: str
    profile_meta: dict[str, Any] = field(default_factory=dict)
    candidates: tuple[dict[str, Any], ...] = ()
    notes: tuple[str, ...] = ()

    # -- derived views -----------------------------------------------------------------------------
    @property
    def num_chunks(self) -> int:
        """p * v: the number of contiguous layer runs (equal to num_ranks without interleaving)."""
        return len(self.boundaries) - 1

    @property
    def num_ranks(self) -> int:
        return int(self.cost_options["num_ranks"])

    @property
    def num_microbatches(self) -> int:
        return int(self.cost_options["num_microbatches"])

    @property
    def schedule(self) -> str:
        return str(self.cost_options["schedule"])

    @property
    def virtual_stages(self) -> int:
        return int(self.cost_options.get("virtual_stages", 1))

    @property
    def method(self) -> str:
        return str(self.cost_options.get("method", "optimal"))

    @property
    def stage_sizes(self) -> list[int]:
        return [self.boundaries[s + 1] - self.boundaries[s] for s in range(self.num_chunks)]

    def simulate(self) -> Simulation:
        """The simulator's step for this plan (per-stage times and one-way boundary comm); its timeline
        feeds ``plots.plot_timeline``."""
        from stageplan.schedules import one_way_delays, simulate

        comm = one_way_delays([st.comm_s for st in self.stages], float(self.cost_options.get("boundary_latency_s", 0.0)))
        return simulate(self.schedule, [st.forward_s for st in self.stages], [st.backward_s for st in self.stages],
                        self.num_microbatches, comm_s=comm, virtual_stages=self.virtual_stages)

    def to_pandas(self) -> pd.DataFrame:
        import pandas as pd

        rows = []
        for st in self.stages:
            row = {"stage": st.index, "rank": st.rank, "layers": f"{st.layers[0]}..{st.layers[-1]}" if len(st.layers) > 1 else st.layers[0],
                   "num_layers": len(st.layers), "forward_s": st.forward_s, "backward_s": st.backward_s, "comm_s": st.comm_s,
                   "time_s": st.time_s, "inflight": st.inflight, "memory_limit_bytes": st.memory_limit_bytes}
            row.update({f"{k}_bytes": v for k, v in st.memory.items()})
            rows.append(row)
        return pd.DataFrame(rows)

    # -- exports (all derived from the boundaries) -------------------------------------------------
    def _named(self) -> list[str]:
        named = self.profile_meta.get("named_layers")
        return list(named) if named else list(self.layer_names)

    def split_spec(self) -> dict[str, str]:
        """torch.distributed.pipelining ``split_spec``: {FQN: "BEGINNING" | "END"} (SplitPoint names)."""
        named = self._named()
        spec: dict[str, str] = {}
        for b in self.boundaries[1:-1]:
            start = self.layer_names[b]
            # A stage that starts at the code after the last named module begins at that code's first module.
            spec[start if start in named else start.split("+")[0]] = "BEGINNING"
        return spec

    def module_fqns_per_model_part(self) -> list[list[str]]:
        """torchtitan ``module_fqns_per_model_part``: module FQNs of each stage (groups expanded)."""
        return [[fqn for name in st.layers for fqn in name.split("+")] for st in self.stages]

    def megatron_layout(self) -> str:
        """Megatron ``--pipeline-model-parallel-layout``: E embedding, t decoder layer, L loss/head, | between stages."""
        named = set(self._named())
        names = self.layer_names
        if len(names) < 3 or names[0] in named or names[-1] in named or any(n not in named for n in names[1:-1]):
            raise StageplanError(
                "a Megatron layout needs an embedding / decoder layers / head model (first and last layers are the "
                f"code around the named blocks); this profile's layers are {', '.join(names[:4])}...; use another export"
            )
        symbols = ["E", *["t"] * (len(names) - 2), "L"]
        parts = ["".join(symbols[self.boundaries[s]:self.boundaries[s + 1]]) for s in range(self.num_chunks)]
        return "|".join(parts)

    def deepspeed_parts(self) -> list[int]:
        """DeepSpeed ``PipelineModule`` parts: stage s holds layers parts[s]..parts[s+1]-1."""
        return list(self.boundaries)

    def torchgpipe_balance(self) -> list[int]:
        """torchgpipe/fairscale ``balance``: the number of layers of each stage."""
        return self.stage_sizes

    def export(self, kind: str) -> Any:
        table = {"split-spec": self.split_spec, "torchtitan": self.module_fqns_per_model_part,
                 "megatron": self.megatron_layout, "deepspeed": self.deepspeed_parts, "torchgpipe": self.torchgpipe_balance}
        if kind not in table:
            raise StageplanError(f"unknown export {kind!r}; use one of {', '.join(EXPORTS)}")
        return table[kind]()

    # -- JSON --------------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["stages"] = [asdict(s) for s in self.stages]
        d["candidates"] = list(self.candidates)
        return {"schema": PLAN_SCHEMA, **d}

    @classmethod
    def from_json(cls, data: dict[str, Any], *, source: str = "plan") -> Plan:
        if data.get("schema") == _OLD_PLAN_SCHEMA:
            data = {("cost_options" if k == "options" else k): v for k, v in data.items()}
        else:
            check_schema(data, PLAN_SCHEMA, source)
        try:
            stages = tuple(StagePlan(**{**s, "layers": tuple(s["layers"])}) for s in data["stages"])
            kwargs = {f.name: data[f.name] for f in fields(cls) if f.name in data}
            kwargs.update(
                stages=stages, boundaries=tuple(data["boundaries"]), layer_names=tuple(data["layer_names"]),
                rank_time_s=tuple(data["rank_time_s"]), rank_memory_bytes=tuple(data["rank_memory_bytes"]),
                rank_peak_activation_bytes=tuple(data["rank_peak_activation_bytes"]),
                candidates=tuple(data.get("candidates", ())), notes=tuple(data.get("notes", ())),
            )
            plan = cls(**kwargs)
        except (KeyError, TypeError) as exc:
            raise SchemaError(f"{source} is missing or mangles field {exc}; regenerate it with stageplan plan") from exc
        validate_boundaries(plan.boundaries, len(plan.layer_names))
        stored = [(st.first_layer, st.end_layer) for st in plan.stages]
        if stored != list(itertools.pairwise(plan.boundaries)):
            cuts = ",".join(str(b) for b in plan.boundaries)
            raise SchemaError(
                f"{source} has boundaries {list(plan.boundaries)} but its evidence was computed for stages "
                f"{[list(x) for x in stored]} (edited by hand?), so its predictions would be stale; re-evaluate that split "
                f"with: stageplan plan PROFILE.json --boundaries {cuts} -o PLAN.json"
            )
        return plan

    def save(self, path: str | os.PathLike[str]) -> None:
        write_json_atomic(path, self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Plan:
        return cls.from_json(read_json(path, "plan"), source=f"plan {str(path)!r}")


def validate_boundaries(boundaries: Sequence[int], num_layers: int) -> None:
    b = list(boundaries)
    if len(b) < 2 or b[0] != 0 or b[-1] != num_layers or any(x >= y for x, y in itertools.pairwise(b)):
        raise SchemaError(
            f"boundaries {b} are not (0, ..., {num_layers}) strictly increasing; every stage must be non-empty and "
            "cover the layers in order; regenerate the plan"
        )


# -- inverse of the exports (used by tests and by users importing other tools' splits) --------------
def boundaries_from_split_spec(spec: dict[str, str], layer_names: Sequence[str]) -> tuple[int, ...]:
    idx = {n: i for i, n in enumerate(layer_names)}
    idx.update({n.split("+")[0]: i for i, n in enumerate(layer_names)})
    cuts = sorted(idx[k] if v == "BEGINNING" else idx[k] + 1 for k, v in spec.items())
    return (0, *cuts, len(layer_names))


def boundaries_from_module_fqns(parts: Sequence[Sequence[str]], layer_names: Sequence[str]) -> tuple[int, ...]:
    first = {fqn: i for i, n in enumerate(layer_names) for fqn in n.split("+")}
    return (*(first[p[0]] for p in parts), len(layer_names))


def boundaries_from_megatron(layout: str) -> tuple[int, ...]:
    sizes = [len(re.sub(r"[^EtL]", "", part)) for part in layout.split("|")]
    out = [0]
    for s in sizes:
        out.append(out[-1] + s)
    return tuple(out)


def boundaries_from_balance(balance: Sequence[int]) -> tuple[int, ...]:
    out = [0]
    for s in balance:
        out.append(out[-1] + int(s))
    return tuple(out)
