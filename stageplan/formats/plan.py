"""Plan: boundaries plus the evidence behind them; exports to other tools' split formats (no torch)."""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

from stageplan._io import check_schema, is_number, malformed, read_json, short_repr, write_json_atomic
from stageplan.errors import SchemaError, StageplanError
from stageplan.formats.interop import named_layers

if TYPE_CHECKING:
    import pandas as pd

    from stageplan.formats.timeline import Simulation

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
    # seconds of one optimizer step over the stage's parameters: once per step, after the rank's last
    # backward; not part of time_s (seconds per microbatch, what the solver balances); 0 in plans made before
    # it existed
    optimizer_s: float = 0.0
    # seconds of the rank's tied-gradient all-reduce (a tied parameter the plan puts on two or more ranks),
    # once per step before the optimizer step; held by the rank's first stage (0 on its others), so that a
    # rank's stages sum to it; 0 in plans made before it existed
    tied_sync_s: float = 0.0
    # seconds per microbatch torch's schedule spends around the stage's forward and its backward outside them
    # (its loop: record_function, building and posting the P2P ops; CostOptions.action_s twice); part of
    # time_s, not of forward_s or backward_s (a run's chunk timers do not see it); 0 without a measured link
    action_s: float = 0.0
    # seconds per microbatch PipelineStage spends inside the stage's forward and backward outside its layers
    # (CostOptions.chunk_forward_s + chunk_backward_s); part of forward_s and backward_s (a run's chunk timers
    # see it); 0 without a measured link
    chunk_s: float = 0.0
    # seconds of the rank's data-parallel gradient sync the step sees (exposed), once per step after its last
    # backward; held by the rank's first stage; 0 with one replica and in plans made before it existed
    dp_sync_s: float = 0.0


@dataclass(frozen=True)
class Evidence:
    """What a partition costs under the cost model (``planning.costs.evaluate``): everything a Plan carries
    besides its boundaries and how it was planned. ``evaluate`` writes the cost model's notes; a Plan's
    evidence adds the planner's (the tie-break, the step search, the bound)."""

    stages: tuple[StagePlan, ...]
    rank_time_s: tuple[float, ...]
    rank_memory_bytes: tuple[float, ...]
    rank_peak_activation_bytes: tuple[float, ...]
    bottleneck_s: float
    lower_bound_s: float
    balance_efficiency: float
    predicted_step_s: float
    bubble_fraction: float
    notes: tuple[str, ...] = ()

    @property
    def tied_sync_s(self) -> float:
        """Seconds of the tied-gradient all-reduce every rank joins once per step (0 when no tie spans ranks):
        each rank's first stage holds it (``StagePlan.tied_sync_s``)."""
        return max((st.tied_sync_s for st in self.stages), default=0.0)


# A plan's JSON (schema stageplan.plan/2): the evidence's figures sit at its top level, beside the plan's own
_EVIDENCE_RANKS = ("rank_time_s", "rank_memory_bytes", "rank_peak_activation_bytes")
_PLAN_KEYS = ("boundaries", "layer_names", "stages", "bottleneck_s", "lower_bound_s", "balance_efficiency",
              "predicted_step_s", "bubble_fraction", "throughput_samples_s", *_EVIDENCE_RANKS, "cost_options",
              "profile_digest", "profile_meta", "candidates", "notes", "tie_break", "step_search",
              "versus_optimal")


@dataclass(frozen=True)
class Plan:
    """Stage boundaries ``(0, b1, ..., L)`` with the evidence behind them.

    Invariants (tested): stages are contiguous, non-empty and cover every layer; ``bottleneck_s`` equals the
    largest stage time (per rank for interleaved schedules, where a rank runs several stages).
    """

    boundaries: tuple[int, ...]
    layer_names: tuple[str, ...]
    evidence: Evidence
    throughput_samples_s: float
    cost_options: dict[str, Any]
    profile_digest: str
    profile_meta: dict[str, Any] = field(default_factory=dict)
    candidates: tuple[dict[str, Any], ...] = ()
    # method "optimal": how the tie-break among equal-bottleneck splits moved the solver's split (boundaries
    # and predicted step before and after, splits simulated, whether every such split was)
    tie_break: dict[str, Any] = field(default_factory=dict)
    # method "optimal": the search for the lowest predicted step whatever the bottleneck, from the tie-break's
    # split (boundaries, step and bottleneck before and after, the rank-time cap it listed under, splits
    # simulated, whether every split under the cap was, and the objective: "step" took its split, "bottleneck"
    # only reports it)
    step_search: dict[str, Any] = field(default_factory=dict)
    # method "given": the split as given, the optimal plan under the same options, bottleneck and step ratios
    # (given / optimal) and memory per rank (need, limit, headroom = limit - need)
    versus_optimal: dict[str, Any] = field(default_factory=dict)

    # -- the evidence's figures, as every reader of a plan names them ------------------------------
    @property
    def notes(self) -> tuple[str, ...]:
        return self.evidence.notes

    def with_notes(self, notes: Sequence[str]) -> Plan:
        """This plan with ``notes`` in place of its notes (the planner adds its own to the cost model's)."""
        return replace(self, evidence=replace(self.evidence, notes=tuple(notes)))

    @property
    def stages(self) -> tuple[StagePlan, ...]:
        return self.evidence.stages

    @property
    def bottleneck_s(self) -> float:
        return self.evidence.bottleneck_s

    @property
    def lower_bound_s(self) -> float:
        return self.evidence.lower_bound_s

    @property
    def balance_efficiency(self) -> float:
        return self.evidence.balance_efficiency

    @property
    def predicted_step_s(self) -> float:
        return self.evidence.predicted_step_s

    @property
    def bubble_fraction(self) -> float:
        return self.evidence.bubble_fraction

    @property
    def rank_time_s(self) -> tuple[float, ...]:
        return self.evidence.rank_time_s

    @property
    def rank_memory_bytes(self) -> tuple[float, ...]:
        return self.evidence.rank_memory_bytes

    @property
    def rank_peak_activation_bytes(self) -> tuple[float, ...]:
        return self.evidence.rank_peak_activation_bytes

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
    def data_parallel(self) -> int:
        """Replicas of the pipeline (d); 1 in plans made before layouts."""
        return int(self.cost_options.get("data_parallel", 1))

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
    def tied_sync_s(self) -> float:
        """Seconds of the tied-gradient all-reduce every rank
        joins once per step (0 when no tie spans ranks)."""
        return max((st.tied_sync_s for st in self.stages), default=0.0)

    @property
    def stage_sizes(self) -> list[int]:
        return [self.boundaries[s + 1] - self.boundaries[s] for s in range(self.num_chunks)]

    def simulate(self) -> Simulation:
        """The simulator's step for this plan (per-stage times and one-way boundary comm); its timeline
        feeds ``plots.plot_timeline``."""
        from stageplan.planning.schedules import one_way_delays, simulate

        comm = one_way_delays([st.comm_s for st in self.stages],
                              float(self.cost_options.get("boundary_latency_s", 0.0)))
        # each forward and each backward with its half of the
        # schedule's loop around the stage (StagePlan.action_s)
        return simulate(self.schedule, [st.forward_s + st.action_s / 2 for st in self.stages],
                        [st.backward_s + st.action_s / 2 for st in self.stages],
                        self.num_microbatches, comm_s=comm, virtual_stages=self.virtual_stages,
                        optimizer_s=[st.optimizer_s for st in self.stages], tied_sync_s=self.tied_sync_s,
                        dp_sync_s=[st.dp_sync_s for st in self.stages])

    def chrome_trace(self) -> dict[str, Any]:
        """The simulated step as Chrome trace-event JSON (Perfetto): a compute and a transfer track per rank
        (:func:`stageplan.formats.trace.chrome_trace`)."""
        from stageplan.formats.trace import chrome_trace

        sim = self.simulate()
        return chrome_trace(sim.timeline, title=f"predicted: {self.schedule}, {self.num_ranks} ranks, "
                            f"{self.num_microbatches} microbatches, step {sim.step_s * 1e3:.3f} ms",
                            meta={"source": "plan", "boundaries": list(self.boundaries),
                                  "predicted_step_s": sim.step_s, "profile_digest": self.profile_digest})

    def to_pandas(self) -> pd.DataFrame:
        import pandas as pd

        rows = []
        for st in self.stages:
            row = {"stage": st.index, "rank": st.rank,
                   "layers": f"{st.layers[0]}..{st.layers[-1]}" if len(st.layers) > 1 else st.layers[0],
                   "num_layers": len(st.layers), "forward_s": st.forward_s, "backward_s": st.backward_s,
                   "comm_s": st.comm_s,
                   "action_s": st.action_s, "chunk_s": st.chunk_s, "time_s": st.time_s,
                   "optimizer_s": st.optimizer_s,
                   "tied_sync_s": st.tied_sync_s, "inflight": st.inflight,
                   "memory_limit_bytes": st.memory_limit_bytes}
            row.update({f"{k}_bytes": v for k, v in st.memory.items()})
            rows.append(row)
        return pd.DataFrame(rows)

    # -- exports (all derived from the boundaries) -------------------------------------------------
    def _named(self) -> list[str]:
        return named_layers(self.layer_names, self.profile_meta)

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
        """Megatron ``--pipeline-model-parallel-layout``: E
        embedding, t decoder layer, L loss/head, | between stages."""
        named = set(self._named())
        names = self.layer_names
        if len(names) < 3 or names[0] in named or names[-1] in named or any(n not in named
                                                                            for n in names[1:-1]):
            raise StageplanError(
                "a Megatron layout needs an embedding / decoder layers / head model (first and last layers "
                f"are the code around the named blocks); this profile's layers are "
                f"{', '.join(names[:4])}...; use another export"
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
                 "megatron": self.megatron_layout, "deepspeed": self.deepspeed_parts,
                 "torchgpipe": self.torchgpipe_balance}
        if kind not in table:
            raise StageplanError(f"unknown export {kind!r}; use one of {', '.join(EXPORTS)}")
        v, p = self.virtual_stages, self.num_ranks
        if v > 1 and kind in ("deepspeed", "torchgpipe"):
            raise StageplanError(f"{kind} places one stage on each rank, and this {self.schedule} plan has "
                                 f"{v} chunks on each of its {p} ranks ({self.num_chunks} stages); export "
                                 "torchtitan or split-spec, or plan with --virtual-stages 1")
        looped = all(st.rank == s % p for s, st in enumerate(self.stages))
        if v > 1 and kind == "megatron" and not looped:
            raise StageplanError(f"Megatron places virtual stages round-robin (stage s on rank s mod {p}), "
                                 f"and this {self.schedule} plan places them otherwise (ranks "
                                 f"{[st.rank for st in self.stages]}); export torchtitan, whose schedule "
                                 f"places them")
        return table[kind]()

    # -- JSON --------------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in _PLAN_KEYS}
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
            lists = {name: _listed(data, name, source) for name in _PLAN_LISTS}
            stages = tuple(_stage(s, k, source) for k, s in enumerate(lists["stages"]))
            evidence = Evidence(stages, lists["rank_time_s"], lists["rank_memory_bytes"],
                                lists["rank_peak_activation_bytes"], bottleneck_s=data["bottleneck_s"],
                                lower_bound_s=data["lower_bound_s"],
                                balance_efficiency=data["balance_efficiency"],
                                predicted_step_s=data["predicted_step_s"],
                                bubble_fraction=data["bubble_fraction"], notes=lists["notes"])
            kwargs = {f.name: data[f.name] for f in fields(cls) if f.name in data}
            kwargs.update({k: v for k, v in lists.items() if k not in (*_EVIDENCE_RANKS, "stages", "notes")})
            plan = cls(**kwargs, evidence=evidence)
        except (KeyError, TypeError) as exc:
            raise malformed(source, exc, "regenerate it with stageplan plan") from exc
        _check_plan_fields(plan, source)
        validate_boundaries(plan.boundaries, len(plan.layer_names))
        stored = [(st.first_layer, st.end_layer) for st in plan.stages]
        if stored != list(itertools.pairwise(plan.boundaries)):
            cuts = ",".join(str(b) for b in plan.boundaries)
            raise SchemaError(
                f"{source} has boundaries {list(plan.boundaries)} but its evidence was computed for stages "
                f"{[list(x) for x in stored]} (edited by hand?), so its predictions would be stale; "
                f"re-evaluate that split with: stageplan plan PROFILE.json --boundaries {cuts} -o PLAN.json"
            )
        return plan

    def save(self, path: str | os.PathLike[str]) -> None:
        write_json_atomic(path, self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Plan:
        return cls.from_json(read_json(path, "plan"), source=f"plan {str(path)!r}")


_PLAN_NUMBERS = ("bottleneck_s", "lower_bound_s", "balance_efficiency", "predicted_step_s", "bubble_fraction",
                 "throughput_samples_s")
_STAGE_NUMBERS = ("forward_s", "backward_s", "comm_s", "time_s", "optimizer_s", "tied_sync_s", "action_s",
                  "dp_sync_s", "chunk_s")


_OPTION_SECONDS = ("boundary_latency_s", "link_latency_s", "action_s", "chunk_forward_s", "chunk_backward_s",
                   "dp_latency_s")
_OPTION_NAMES = ("method", "objective", "optimizer", "precision", "sharding", "grad_dtype")


def check_cost_options(cost: dict[str, Any], bad: Callable[[str, Any], Exception]) -> None:
    """Refuse (``bad(what, value)``) a plan's options that show, run and calibrate compute with when they are
    of the wrong kind: the schedule and microbatch counts, the link's seconds and bandwidth, the devices, the
    names. A hand-edited file otherwise ended in a traceback there."""
    counts = {"num_microbatches": cost.get("num_microbatches"),
              "virtual_stages": cost.get("virtual_stages", 1), "data_parallel": cost.get("data_parallel", 1)}
    if cost.get("microbatch_size") is not None:  # null: a plan priced at the profile's own size
        counts["microbatch_size"] = cost["microbatch_size"]
    for key, value in counts.items():
        if isinstance(value, bool) or not (isinstance(value, int) and value >= 1):
            raise bad(f"cost_options' {key} must be an integer >= 1", value)
    if not isinstance(cost.get("schedule"), str):
        raise bad("cost_options' schedule must be a name such as '1F1B'", cost.get("schedule"))
    for key in _OPTION_SECONDS:
        value = cost.get(key)
        if value is not None and not (is_number(value) and value >= 0):
            raise bad(f"cost_options' {key} must be seconds >= 0 or null", value)
    bandwidth = cost.get("bandwidth_bytes_per_s")
    if bandwidth is not None and not (is_number(bandwidth) and bandwidth > 0):
        raise bad("cost_options' bandwidth_bytes_per_s must be bytes/s > 0 or null (not modelled)", bandwidth)
    for key in _OPTION_NAMES:
        if cost.get(key) is not None and not isinstance(cost[key], str):
            raise bad(f"cost_options' {key} must be a name or null", cost[key])
    if cost.get("recompute") is not None and not isinstance(cost["recompute"], bool):
        raise bad("cost_options' recompute must be true or false", cost["recompute"])
    devices = cost.get("devices")
    if devices is not None and not (isinstance(devices, list) and all(
            isinstance(d, dict) and is_number(d.get("speed")) and d["speed"] > 0
            and (d.get("memory_limit_bytes") is None
                 or (is_number(d["memory_limit_bytes"]) and d["memory_limit_bytes"] > 0))
            for d in devices)):
        raise bad("cost_options' devices must be a list of {speed > 0, memory_limit_bytes > 0 or null}",
                  devices)


# the plan file's fields that are lists (stored as tuples); candidates and notes may be absent
_PLAN_LISTS = ("stages", "boundaries", "layer_names", "rank_time_s", "rank_memory_bytes",
               "rank_peak_activation_bytes", "candidates", "notes")


def _listed(data: dict[str, Any], name: str, source: str) -> tuple[Any, ...]:
    """A list field of a plan file as a tuple; one line naming the field when it is not a list (a scalar had
    been refused with Python's own "'int' object is not iterable")."""
    value = data[name] if name not in ("candidates", "notes") else data.get(name, [])
    if not isinstance(value, (list, tuple)):
        # tuple: a Plan's to_json() handed over without a JSON round trip
        raise SchemaError(
            f"{source}: {name} must be a list, got {short_repr(value)}; regenerate it with stageplan plan")
    return tuple(value)


def _stage(row: Any, k: int, source: str) -> StagePlan:
    """Stage k of a plan file, or one line naming it when it is not an object of StagePlan's fields."""
    if not isinstance(row, dict) or not isinstance(row.get("layers"), (list, tuple)):
        raise SchemaError(f"{source}: stages[{k}] must be an object with a list of layers, got "
                          f"{short_repr(row)}; "
                          "regenerate it with stageplan plan")
    try:
        return StagePlan(**{**row, "layers": tuple(row["layers"])})
    except TypeError as exc:  # a field StagePlan does not have, or one it needs missing
        raise SchemaError(f"{source}: stages[{k}] does not match a stage's fields ({exc}); regenerate it "
                          "with stageplan plan") from exc


def _check_plan_fields(plan: Plan, source: str) -> None:
    """Refuse (SchemaError, one line) a plan file whose figures show and run read are of the wrong kind: its
    predictions, its per-rank lists, its options, its layer names and its stages' evidence."""
    def bad(what: str, value: Any) -> SchemaError:
        return SchemaError(f"{source}: {what}, got {short_repr(value)}; regenerate it with stageplan plan")

    for name in ("cost_options", "profile_meta", "tie_break", "step_search", "versus_optimal"):
        if not isinstance(getattr(plan, name), dict):
            raise bad(f"{name} must be an object", getattr(plan, name))
    p = plan.cost_options.get("num_ranks")
    if not (isinstance(p, int) and not isinstance(p, bool) and p >= 1):
        raise bad("cost_options' num_ranks must be an integer >= 1", p)
    for name in _PLAN_NUMBERS:
        if name == "throughput_samples_s" and getattr(plan, name) in (None, math.inf):
            continue  # a step predicted at 0 s (a profile of zero costs): written as null
        if not is_number(getattr(plan, name)):
            raise bad(f"{name} must be a finite number", getattr(plan, name))
    for name in ("rank_time_s", "rank_memory_bytes", "rank_peak_activation_bytes"):
        values = getattr(plan, name)
        if len(values) != p or not all(is_number(v) for v in values):
            raise bad(f"{name} must hold a finite number for each of its {p} ranks", list(values))
    if not all(isinstance(b, int) and not isinstance(b, bool) for b in plan.boundaries):
        raise bad("boundaries must be integers", list(plan.boundaries))
    odd = [n for n in plan.layer_names if not isinstance(n, str)]
    if odd:
        raise bad("layer_names must be names", odd[0])
    check_cost_options(plan.cost_options, bad)
    odd_candidates = [c for c in plan.candidates if not isinstance(c, dict)]
    if odd_candidates:
        raise bad("candidates must be a list of objects (boundaries, predicted_step_s)", odd_candidates[0])
    for st in plan.stages:
        if not (isinstance(st.rank, int) and 0 <= st.rank < p) or not all(is_number(getattr(st, k))
                                                                          for k in _STAGE_NUMBERS):
            raise bad(f"stage {st.index} must run on a rank 0..{p - 1} with finite times",
                      {k: getattr(st, k) for k in ("rank", *_STAGE_NUMBERS)})
        if not (st.layers and all(isinstance(n, str) for n in st.layers)):
            raise bad(f"stage {st.index}'s layers must name its layers", list(st.layers))
        if not (isinstance(st.memory, dict) and st.memory and all(is_number(v) for v in st.memory.values())):
            raise bad(f"stage {st.index}'s memory must map each kind to bytes", st.memory)
        limit = st.memory_limit_bytes
        if limit is not None and not (is_number(limit) and limit > 0):
            raise bad(f"stage {st.index}'s memory_limit_bytes must be bytes > 0 or null", limit)


def validate_boundaries(boundaries: Sequence[int], num_layers: int) -> None:
    b = list(boundaries)
    if len(b) < 2 or b[0] != 0 or b[-1] != num_layers or any(x >= y for x, y in itertools.pairwise(b)):
        raise SchemaError(
            f"boundaries {b} are not (0, ..., {num_layers}) strictly increasing; every stage must be "
            "non-empty and cover the layers in order; regenerate the plan"
        )
