"""Plan: boundaries plus the evidence behind them; exports to other tools' split formats (no torch)."""

from __future__ import annotations

import itertools
import math
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any, NoReturn

from stageplan._io import check_schema, is_number, malformed, read_json, short_repr, write_json_atomic
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
    # seconds of one optimizer step over the stage's parameters: once per step, after the rank's last backward;
    # not part of time_s (seconds per microbatch, what the solver balances); 0 in plans made before it existed
    optimizer_s: float = 0.0
    # seconds of the rank's tied-gradient all-reduce (a tied parameter the plan puts on two or more ranks), once per
    # step before the optimizer step; held by the rank's first stage (0 on its others), so that a rank's stages sum
    # to it; 0 in plans made before it existed
    tied_sync_s: float = 0.0
    # seconds per microbatch torch's schedule spends around the stage's forward and its backward outside them (its
    # loop: record_function, building and posting the P2P ops; CostOptions.action_s twice); part of time_s, not of
    # forward_s or backward_s (a run's chunk timers do not see it); 0 without a measured link
    action_s: float = 0.0
    # seconds per microbatch PipelineStage spends inside the stage's forward and backward outside its layers
    # (CostOptions.chunk_forward_s + chunk_backward_s); part of forward_s and backward_s (a run's chunk timers see
    # it); 0 without a measured link
    chunk_s: float = 0.0


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
    # method "optimal": how the tie-break among equal-bottleneck splits moved the solver's split (boundaries and
    # predicted step before and after, splits simulated, whether every such split was)
    tie_break: dict[str, Any] = field(default_factory=dict)
    # method "optimal": the search for the lowest predicted step whatever the bottleneck, from the tie-break's split
    # (boundaries, step and bottleneck before and after, the rank-time cap it listed under, splits simulated, whether
    # every split under the cap was, and the objective: "step" took its split, "bottleneck" only reports it)
    step_search: dict[str, Any] = field(default_factory=dict)
    # method "given": the split as given, the optimal plan under the same options, bottleneck and step ratios
    # (given / optimal) and memory per rank (need, limit, headroom = limit - need)
    versus_optimal: dict[str, Any] = field(default_factory=dict)

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
    def tied_sync_s(self) -> float:
        """Seconds of the tied-gradient all-reduce every rank joins once per step (0 when no tie spans ranks)."""
        return max((st.tied_sync_s for st in self.stages), default=0.0)

    @property
    def stage_sizes(self) -> list[int]:
        return [self.boundaries[s + 1] - self.boundaries[s] for s in range(self.num_chunks)]

    def simulate(self) -> Simulation:
        """The simulator's step for this plan (per-stage times and one-way boundary comm); its timeline
        feeds ``plots.plot_timeline``."""
        from stageplan.schedules import one_way_delays, simulate

        comm = one_way_delays([st.comm_s for st in self.stages], float(self.cost_options.get("boundary_latency_s", 0.0)))
        # each forward and each backward with its half of the schedule's loop around the stage (StagePlan.action_s)
        return simulate(self.schedule, [st.forward_s + st.action_s / 2 for st in self.stages],
                        [st.backward_s + st.action_s / 2 for st in self.stages],
                        self.num_microbatches, comm_s=comm, virtual_stages=self.virtual_stages,
                        optimizer_s=[st.optimizer_s for st in self.stages], tied_sync_s=self.tied_sync_s)

    def to_pandas(self) -> pd.DataFrame:
        import pandas as pd

        rows = []
        for st in self.stages:
            row = {"stage": st.index, "rank": st.rank, "layers": f"{st.layers[0]}..{st.layers[-1]}" if len(st.layers) > 1 else st.layers[0],
                   "num_layers": len(st.layers), "forward_s": st.forward_s, "backward_s": st.backward_s, "comm_s": st.comm_s,
                   "action_s": st.action_s, "chunk_s": st.chunk_s, "time_s": st.time_s, "optimizer_s": st.optimizer_s,
                   "tied_sync_s": st.tied_sync_s, "inflight": st.inflight, "memory_limit_bytes": st.memory_limit_bytes}
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
        v, p = self.virtual_stages, self.num_ranks
        if v > 1 and kind in ("deepspeed", "torchgpipe"):
            raise StageplanError(f"{kind} places one stage on each rank, and this {self.schedule} plan has {v} chunks on "
                                 f"each of its {p} ranks ({self.num_chunks} stages); export torchtitan or split-spec, or "
                                 "plan with --virtual-stages 1")
        looped = all(st.rank == s % p for s, st in enumerate(self.stages))
        if v > 1 and kind == "megatron" and not looped:
            raise StageplanError(f"Megatron places virtual stages round-robin (stage s on rank s mod {p}), and this "
                                 f"{self.schedule} plan places them otherwise (ranks "
                                 f"{[st.rank for st in self.stages]}); export torchtitan, whose schedule places them")
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
            lists = {name: _listed(data, name, source) for name in _PLAN_LISTS}
            stages = tuple(_stage(s, k, source) for k, s in enumerate(lists["stages"]))
            kwargs = {f.name: data[f.name] for f in fields(cls) if f.name in data}
            kwargs.update(lists, stages=stages)
            plan = cls(**kwargs)
        except (KeyError, TypeError) as exc:
            raise malformed(source, exc, "regenerate it with stageplan plan") from exc
        _check_plan_fields(plan, source)
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


_PLAN_NUMBERS = ("bottleneck_s", "lower_bound_s", "balance_efficiency", "predicted_step_s", "bubble_fraction",
                 "throughput_samples_s")
_STAGE_NUMBERS = ("forward_s", "backward_s", "comm_s", "time_s", "optimizer_s", "tied_sync_s", "action_s", "chunk_s")


_OPTION_SECONDS = ("boundary_latency_s", "link_latency_s", "action_s", "chunk_forward_s", "chunk_backward_s")
_OPTION_NAMES = ("method", "objective", "optimizer", "precision")


def check_cost_options(cost: dict[str, Any], bad: Callable[[str, Any], Exception]) -> None:
    """Refuse (``bad(what, value)``) a plan's options that show, run and calibrate compute with when they are of the
    wrong kind: the schedule and microbatch counts, the link's seconds and bandwidth, the devices, the names. A
    hand-edited file otherwise ended in a traceback there."""
    counts = {"num_microbatches": cost.get("num_microbatches"), "virtual_stages": cost.get("virtual_stages", 1)}
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
            and (d.get("memory_limit_bytes") is None or (is_number(d["memory_limit_bytes"]) and d["memory_limit_bytes"] > 0))
            for d in devices)):
        raise bad("cost_options' devices must be a list of {speed > 0, memory_limit_bytes > 0 or null}", devices)


# the plan file's fields that are lists (stored as tuples); candidates and notes may be absent
_PLAN_LISTS = ("stages", "boundaries", "layer_names", "rank_time_s", "rank_memory_bytes", "rank_peak_activation_bytes",
               "candidates", "notes")


def _listed(data: dict[str, Any], name: str, source: str) -> tuple[Any, ...]:
    """A list field of a plan file as a tuple; one line naming the field when it is not a list (a scalar had been
    refused with Python's own "'int' object is not iterable")."""
    value = data[name] if name not in ("candidates", "notes") else data.get(name, [])
    if not isinstance(value, (list, tuple)):  # tuple: a Plan's to_json() handed over without a JSON round trip
        raise SchemaError(f"{source}: {name} must be a list, got {short_repr(value)}; regenerate it with stageplan plan")
    return tuple(value)


def _stage(row: Any, k: int, source: str) -> StagePlan:
    """Stage k of a plan file, or one line naming it when it is not an object of StagePlan's fields."""
    if not isinstance(row, dict) or not isinstance(row.get("layers"), (list, tuple)):
        raise SchemaError(f"{source}: stages[{k}] must be an object with a list of layers, got {short_repr(row)}; "
                          "regenerate it with stageplan plan")
    try:
        return StagePlan(**{**row, "layers": tuple(row["layers"])})
    except TypeError as exc:  # a field StagePlan does not have, or one it needs missing
        raise SchemaError(f"{source}: stages[{k}] does not match a stage's fields ({exc}); regenerate it with "
                          "stageplan plan") from exc


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
        if not (isinstance(st.rank, int) and 0 <= st.rank < p) or not all(is_number(getattr(st, k)) for k in _STAGE_NUMBERS):
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
            f"boundaries {b} are not (0, ..., {num_layers}) strictly increasing; every stage must be non-empty and "
            "cover the layers in order; regenerate the plan"
        )


# -- inverse of the exports (users scoring the split they run today with another tool, and tests) --------------
def named_layers(layer_names: Sequence[str], meta: dict[str, Any]) -> list[str]:
    """The profile's named blocks (``meta["named_layers"]``); every layer when the profile does not say."""
    named = meta.get("named_layers")
    return list(named) if named else list(layer_names)


def boundaries_from_split_spec(spec: dict[str, str], layer_names: Sequence[str]) -> tuple[int, ...]:
    idx = {n: i for i, n in enumerate(layer_names)}
    idx.update({n.split("+")[0]: i for i, n in enumerate(layer_names)})
    cuts = sorted(idx[k] if v == "BEGINNING" else idx[k] + 1 for k, v in spec.items())
    return (0, *cuts, len(layer_names))


def _layer_list(names: Sequence[str], idx: Sequence[int]) -> str:
    shown = ", ".join(repr(names[i]) for i in idx[:4])
    return shown + (f" and {len(idx) - 4} more" if len(idx) > 4 else "")


def boundaries_from_module_fqns(parts: Sequence[Sequence[str]], layer_names: Sequence[str]) -> tuple[int, ...]:
    """Boundaries from torchtitan's ``module_fqns_per_model_part`` (one list of module FQNs per stage, in order).

    An FQN names a layer of the profile or one module of a grouped layer (``tok_emb`` of ``tok_emb+pos_emb``).
    Refused, one rule each: an FQN the profile does not have, one listed twice, an empty part, a grouped layer
    split between parts, a part whose layers are not one contiguous run, parts out of the model's order, and
    modules that are in no part.

    >>> boundaries_from_module_fqns([["emb", "b.0"], ["b.1", "head"]], ["emb", "b.0", "b.1", "head"])
    (0, 2, 4)
    """
    example = '[["tok_embeddings", "layers.0"], ["layers.1", "norm", "output"]]'
    if not isinstance(parts, (list, tuple)) or not all(
            isinstance(part, (list, tuple)) and all(isinstance(f, str) for f in part) for part in parts):
        raise StageplanError(f"module FQNs per model part must be a list of lists of module names (torchtitan's "
                             f"module_fqns_per_model_part), got {str(parts)[:80]!r}; e.g. {example}")
    members = [name.split("+") for name in layer_names]
    owner = {fqn: i for i, group in enumerate(members) for fqn in group}
    owner.update({name: i for i, name in enumerate(layer_names)})
    where: dict[str, int] = {}  # module FQN -> part
    for k, part in enumerate(parts):
        if not part:
            raise StageplanError(f"part {k} of the module FQNs is empty; every stage needs at least one layer: drop "
                                 "the empty part and plan one stage fewer")
        for fqn in part:
            if fqn not in owner:
                raise StageplanError(
                    f"part {k} names {fqn!r}, which is no layer of this profile (its layers are "
                    f"{_layer_list(layer_names, list(range(len(layer_names))))}); use the profile's layer FQNs, as "
                    "stageplan plan --export torchtitan writes them")
            for module in members[owner[fqn]] if fqn == layer_names[owner[fqn]] else [fqn]:
                if module in where:
                    twice = f"twice in part {k}" if where[module] == k else f"in part {where[module]} and in part {k}"
                    raise StageplanError(f"{module!r} is listed {twice}; each module belongs to exactly one part")
                where[module] = k
    layer_part: list[int] = []  # the part holding each layer, -1 when none does
    for i, group in enumerate(members):
        in_parts = sorted({where[m] for m in group if m in where})
        if len(in_parts) > 1:
            raise StageplanError(
                f"{layer_names[i]!r} was profiled as one layer but its modules sit in parts "
                f"{', '.join(map(str, in_parts))}; put them in one part, or profile them as separate layers "
                "(stageplan profile --layers)")
        layer_part.append(in_parts[0] if in_parts else -1)
    end = 0  # where the parts so far end
    for k in range(len(parts)):
        held = [i for i, q in enumerate(layer_part) if q == k]
        if held[0] < end:
            raise StageplanError(
                f"part {k} starts at layer {held[0]} ({layer_names[held[0]]!r}), before part {k - 1} ends (layer "
                f"{end - 1}); parts follow the model's order, the first layers in part 0")
        gaps = [i for i in range(held[0], held[-1] + 1) if layer_part[i] != k]
        if gaps:
            raise StageplanError(
                f"part {k} holds layers {held[0]}..{held[-1]} but not {_layer_list(layer_names, gaps)}; a stage is "
                "one contiguous run of layers")
        end = held[-1] + 1
    absent = [i for i, q in enumerate(layer_part) if q < 0]
    missing = [m for group in members for m in group if m not in where]
    if absent or missing:
        what = _layer_list(layer_names, absent) if absent else ", ".join(repr(m) for m in missing[:4])
        raise StageplanError(f"{what} {'is' if len(absent or missing) == 1 else 'are'} in no part; every module of "
                             "the profile must be in exactly one part")
    bounds = [0]
    for k in range(len(parts)):
        bounds.append(max(i for i, q in enumerate(layer_part) if q == k) + 1)
    return tuple(bounds)


# Megatron's --pipeline-model-parallel-layout symbols (megatron/core/transformer/pipeline_parallel_layer_layout.py)
MEGATRON_SYMBOLS = {"E": "embedding", "t": "decoder layer", "L": "loss/head", "m": "multi-token-prediction (MTP) layer"}
# The longest layout read: a count beyond it is a typo, and writing it out would exhaust memory first
MEGATRON_MAX_SYMBOLS = 1_000_000
MEGATRON_MAX_DEPTH = 64  # groups inside groups (Megatron itself does not nest them); the reader recurses per level


def expand_megatron_layout(layout: str) -> list[list[str]]:
    """Megatron's ``--pipeline-model-parallel-layout`` written out: one list of symbols per stage (empty stages kept).

    Grammar: symbols E (embedding), t (decoder layer), m (MTP layer), L (loss/head); ``|`` ends a stage; ``X*n``
    repeats a symbol and ``(...)*n`` a group, which may hold ``|`` and so repeat whole stages, and may nest
    (Megatron itself does not nest groups); commas and spaces are cosmetic.

    >>> expand_megatron_layout("E,t*2|(t|)*2,L")
    [['E', 't', 't'], ['t'], ['t'], ['L']]
    """
    text = "".join(ch for ch in layout if ch not in ", \t")
    pos = 0

    def fail(why: str) -> NoReturn:
        raise StageplanError(f"cannot read Megatron layout {short_repr(layout)}: {why} (at character {pos} of "
                             f"{short_repr(text)}); "
                             "write symbols E, t, m, L, '|' between stages, X*n or (group)*n to repeat, e.g. "
                             "'Et*3|(tt|)*2,tL'")

    def count() -> int:
        nonlocal pos
        digits = re.match(r"\d+", text[pos:])
        if digits is None:
            fail("'*' must be followed by a count")
        pos += len(digits.group())
        if len(digits.group().lstrip("0")) > len(str(MEGATRON_MAX_SYMBOLS)):  # int() refuses past 4300 digits
            fail(f"the count {short_repr(digits.group())} repeats to more than {MEGATRON_MAX_SYMBOLS:,} symbols, more "
                 "layers than any model has; check the counts")
        return int(digits.group().lstrip("0") or "0")

    def sequence(depth: int) -> list[str]:
        nonlocal pos
        out: list[str] = []
        while pos < len(text):
            ch = text[pos]
            if ch == ")":
                if depth == 0:
                    fail("')' without '('")
                return out
            pos += 1
            if ch == "|":
                if pos < len(text) and text[pos] == "*":
                    fail("'*n' must follow a symbol or a parenthesised group, not '|'")
                out.append("|")
                continue
            if ch == "(":
                if depth >= MEGATRON_MAX_DEPTH:
                    fail(f"groups nest deeper than {MEGATRON_MAX_DEPTH} levels; write the layout with fewer '('")
                item = sequence(depth + 1)
                if pos >= len(text):
                    fail("'(' without ')'")
                pos += 1
                if not item:
                    fail("empty group '()'")
            elif ch in MEGATRON_SYMBOLS:
                item = [ch]
            elif ch == "*":
                pos -= 1
                fail("'*n' must follow a symbol or a parenthesised group")
            else:
                pos -= 1
                fail(f"unknown symbol {ch!r}")
            if pos < len(text) and text[pos] == "*":
                pos += 1
                n = count()
                if len(out) + len(item) * n > MEGATRON_MAX_SYMBOLS:
                    fail(f"it repeats to more than {MEGATRON_MAX_SYMBOLS:,} symbols ({len(item):,} x {n:,}), more "
                         "layers than any model has; check the counts")
                item = item * n
            if len(out) + len(item) > MEGATRON_MAX_SYMBOLS:
                fail(f"it writes out to more than {MEGATRON_MAX_SYMBOLS:,} symbols, more layers than any model has; "
                     "check the counts")
            out.extend(item)
        if depth:
            fail("'(' without ')'")
        return out

    stages: list[list[str]] = [[]]
    for sym in sequence(0):
        if sym == "|":
            stages.append([])
        else:
            stages[-1].append(sym)
    return stages


def megatron_symbols(layer_names: Sequence[str], named: Sequence[str]) -> list[str | None]:
    """The Megatron symbol of each profiled layer: E the code before the named blocks (the first layer), t a named
    block, L the code after them (the last layer); None for a layer no symbol stands for."""
    is_named = set(named)
    last = len(layer_names) - 1
    return ["t" if n in is_named else "E" if i == 0 else "L" if i == last else None for i, n in enumerate(layer_names)]


def _symbol_counts(symbols: Sequence[str | None]) -> str:
    return ", ".join(f"{symbols.count(s)} {s}" for s in "EtL" if symbols.count(s)) or "no E, t or L"


def boundaries_from_megatron(layout: str, layer_names: Sequence[str] | None = None,
                             named: Sequence[str] | None = None) -> tuple[int, ...]:
    """Boundaries from Megatron's ``--pipeline-model-parallel-layout`` (see :func:`expand_megatron_layout`).

    With ``layer_names`` (and the profile's ``named`` blocks), each symbol is mapped onto the profile's layers:
    E the first layer, t each named block, L the last layer; a layout whose symbols do not match the profile's
    is refused with both counts. Stages must be non-empty; m (MTP) has no layer in a stageplan profile.

    >>> boundaries_from_megatron("E,t*4|t*4,L")
    (0, 5, 10)
    """
    stages = expand_megatron_layout(layout)
    flat = [s for stage in stages for s in stage]
    if "m" in flat:
        raise StageplanError(
            f"Megatron layout {layout!r} holds 'm', a multi-token-prediction (MTP) layer; a stageplan profile has no "
            "MTP layer to map it onto (E is the first layer, t each named block, L the last layer): score the "
            "layout without its m symbols (and without a stage that holds only m)")
    if not flat:
        raise StageplanError(f"Megatron layout {layout!r} holds no layers; write one symbol per layer and '|' between "
                             "stages, e.g. 'E,t*4|t*4,L'")
    empty = [k for k, stage in enumerate(stages) if not stage]
    if empty:
        raise StageplanError(
            f"Megatron layout {layout!r} has {len(stages)} stages and stage {empty[0]} is empty; Megatron allows "
            "empty stages, a stageplan split needs at least one layer per stage: drop that stage's '|' and plan "
            "one stage fewer")
    if layer_names is not None:
        profile = megatron_symbols(layer_names, list(layer_names) if named is None else named)
        odd = [i for i, s in enumerate(profile) if s is None]
        if odd:
            raise StageplanError(
                f"layer {odd[0]} of the profile ({layer_names[odd[0]]!r}) is neither the first layer, the last layer "
                "nor a named block, so no Megatron symbol stands for it; score this split with --boundaries or --fqns")
        if flat != profile:
            if _symbol_counts(flat) != _symbol_counts(profile):
                raise StageplanError(
                    f"Megatron layout {layout!r} has {_symbol_counts(flat)} ({len(flat)} layers) but the profile "
                    f"has {_symbol_counts(profile)} ({len(profile)} layers: E = {layer_names[0]!r}, t = each named "
                    f"block, L = {layer_names[-1]!r}); write a layout with {_symbol_counts(profile)}")
            i = next(i for i, (a, b) in enumerate(zip(flat, profile)) if a != b)
            raise StageplanError(
                f"Megatron layout {layout!r} has {flat[i]!r} at layer {i} where the profile has {profile[i]} "
                f"({layer_names[i]!r}); E comes first, L last, t in between")
    out = [0]
    for stage in stages:
        out.append(out[-1] + len(stage))
    return tuple(out)


def boundaries_from_balance(balance: Sequence[int]) -> tuple[int, ...]:
    out = [0]
    for s in balance:
        out.append(out[-1] + int(s))
    return tuple(out)
