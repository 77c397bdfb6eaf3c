"""Layout / Candidate: the ranked layouts for N devices, each with its degrees, split and evidence; versioned
JSON (no torch)."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from stageplan._io import check_schema, read_json, write_json_atomic
from stageplan.errors import SchemaError, StageplanError
from stageplan.formats.plan import Plan

LAYOUT_SCHEMA = "stageplan.layout/1"

# Where each export goes. torchtitan's field names changed between releases (module_fqns_per_model_part,
# later pipeline_parallel_split_points and [training] batch sizes): this export writes the fields of
# torchtitan/config/job_config.py at commit 000204a4a8bf (2025), and says so in its first line.
TORCHTITAN_RELEASE = "torchtitan/config/job_config.py at commit 000204a4a8bf"
LAYOUT_EXPORTS = ("torchtitan", "megatron", "deepspeed")

# The parts of a candidate's predicted step, in seconds (planning.layouts prices each; they sum to the step):
# the compute of the slowest rank's microbatches, the pipeline's fill and drain, the transfers between
# stages, the exposed data-parallel sync, the tensor-parallel all-reduces, and the optimizer step.
STEP_PARTS = ("compute_s", "bubble_s", "pipeline_transfer_s", "dp_sync_s", "tp_comm_s", "optimizer_s")


@dataclass(frozen=True)
class Candidate:
    """One point of the layout grid, priced with its exact split (or the reason it was not).

    Degrees: ``pipeline_parallel`` (p) x ``data_parallel`` (d) x ``tensor_parallel`` (t) = the devices;
    ``microbatch_size`` (b) x ``num_microbatches`` (m) x d = the global batch. ``memory_bytes`` is the fullest
    device's memory by kind; ``step_parts`` the predicted step's parts (:data:`STEP_PARTS`)."""

    tensor_parallel: int
    pipeline_parallel: int
    data_parallel: int
    microbatch_size: int
    num_microbatches: int
    schedule: str
    virtual_stages: int
    recompute: bool
    sharding: str
    sequence_parallel: bool = False
    boundaries: tuple[int, ...] | None = None
    predicted_step_s: float | None = None
    simulated_step_s: float | None = None
    lower_bound_step_s: float | None = None
    peak_memory_bytes: float | None = None
    memory_bytes: dict[str, float] = field(default_factory=dict)
    rank_memory_bytes: tuple[float, ...] = ()
    step_parts: dict[str, float] = field(default_factory=dict)
    tokens_per_s_per_device: float | None = None
    mfu: float | None = None
    hfu: float | None = None
    feasible: bool = True
    reason: str | None = None
    scaled_from_microbatch_size: int | None = None
    spans_nodes: tuple[str, ...] = ()
    placement: str = "tp,dp,pp"  # the groups' order on the devices, innermost first

    @property
    def degrees(self) -> str:
        """e.g. "tp4 pp8 dp2 b1 m64 Interleaved1F1B v5 zero1"."""
        sched = self.schedule + (f" v{self.virtual_stages}" if self.virtual_stages > 1 else "")
        extra = (" sp" if self.sequence_parallel else "") + (" recompute" if self.recompute else "")
        return (f"tp{self.tensor_parallel} pp{self.pipeline_parallel} dp{self.data_parallel} "
                f"b{self.microbatch_size} m{self.num_microbatches} {sched} {self.sharding}{extra}")

    @property
    def step_s(self) -> float:
        """The step the ranking uses: the simulated one where the simulator ran, else the closed form."""
        if self.simulated_step_s is not None:
            return self.simulated_step_s
        return float("inf") if self.predicted_step_s is None else self.predicted_step_s

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["boundaries"] = None if self.boundaries is None else list(self.boundaries)
        d["rank_memory_bytes"] = list(self.rank_memory_bytes)
        d["spans_nodes"] = list(self.spans_nodes)
        return d

    @classmethod
    def from_json(cls, data: dict[str, Any], source: str = "layout") -> Candidate:
        if not isinstance(data, dict):
            raise SchemaError(f"{source}: a candidate must be an object, got {type(data).__name__}; "
                              "regenerate it with stageplan layout")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise SchemaError(f"{source}: unknown candidate field(s) {unknown}; regenerate it with stageplan "
                              "layout")
        row = dict(data)
        for key in ("boundaries", "rank_memory_bytes", "spans_nodes"):
            if row.get(key) is not None:
                row[key] = tuple(row[key])
        try:
            return cls(**row)
        except TypeError as exc:
            raise SchemaError(f"{source}: a candidate is missing a field ({exc}); regenerate it with "
                              "stageplan layout") from None


@dataclass(frozen=True)
class Layout:
    """The layouts of a model on ``num_devices`` devices, best first, with the search's counts and proof.

    ``candidates`` holds the feasible candidates ranked by step (the simulator ran on the first ``top``),
    ``rejected`` one row per family of rejected candidates and why (memory by how much, or time),
    ``counts`` how many were priced, pruned by a bound, and infeasible, ``plan`` the best one's Plan (what
    ``stageplan run``, ``show`` and the exports take), ``given`` the user's own layout scored the same way."""

    num_devices: int
    devices_per_node: int
    global_batch_size: int
    memory_limit_bytes: float | None
    candidates: tuple[Candidate, ...]
    rejected: tuple[dict[str, Any], ...] = ()
    counts: dict[str, int] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    plan: Plan | None = None
    given: Candidate | None = None
    notes: tuple[str, ...] = ()
    # priced candidates whose fullest device is over the limit, with their memory (for the figure)
    over_limit: tuple[Candidate, ...] = ()

    @property
    def best(self) -> Candidate:
        return self.candidates[0]

    @property
    def margin(self) -> float | None:
        """How much slower the runner-up is than the best (0.05 = 5%); None with one candidate."""
        if len(self.candidates) < 2:
            return None
        return self.candidates[1].step_s / self.best.step_s - 1.0

    def to_json(self) -> dict[str, Any]:
        return {"schema": LAYOUT_SCHEMA, "num_devices": self.num_devices,
                "devices_per_node": self.devices_per_node, "global_batch_size": self.global_batch_size,
                "memory_limit_bytes": self.memory_limit_bytes,
                "candidates": [c.to_json() for c in self.candidates], "rejected": list(self.rejected),
                "counts": dict(self.counts), "options": dict(self.options),
                "plan": None if self.plan is None else self.plan.to_json(),
                "given": None if self.given is None else self.given.to_json(), "notes": list(self.notes),
                "over_limit": [c.to_json() for c in self.over_limit]}

    @classmethod
    def from_json(cls, data: dict[str, Any], *, source: str = "layout") -> Layout:
        check_schema(data, LAYOUT_SCHEMA, source)
        try:
            cands = tuple(Candidate.from_json(c, source) for c in data["candidates"])
            return cls(int(data["num_devices"]), int(data["devices_per_node"]),
                       int(data["global_batch_size"]),
                       data.get("memory_limit_bytes"), cands, tuple(data.get("rejected", [])),
                       dict(data.get("counts", {})), dict(data.get("options", {})),
                       None if data.get("plan") is None else Plan.from_json(data["plan"], source=source),
                       None if data.get("given") is None else Candidate.from_json(data["given"], source),
                       tuple(data.get("notes", [])),
                       tuple(Candidate.from_json(c, source) for c in data.get("over_limit", [])))
        except (KeyError, TypeError, ValueError) as exc:
            raise SchemaError(f"{source}: not a layout file ({type(exc).__name__}: {exc}); regenerate it "
                              "with stageplan layout") from None

    def save(self, path: str | os.PathLike[str]) -> None:
        write_json_atomic(path, self.to_json())

    # -- exports of the best layout ----------------------------------------------------------------
    def export(self, kind: str) -> str:
        """The best layout for another tool: "torchtitan" (a TOML fragment), "megatron" (command-line
        arguments) or "deepspeed" (a JSON config); one line refuses what the tool cannot run."""
        if kind not in LAYOUT_EXPORTS:
            raise StageplanError(f"unknown layout export {kind!r}; use one of {', '.join(LAYOUT_EXPORTS)}")
        if self.plan is None:
            raise StageplanError(
                "this layout file holds no plan of its best layout; run stageplan layout again")
        return {"torchtitan": self._torchtitan, "megatron": self._megatron, "deepspeed": self._deepspeed}[
            kind
        ]()

    def _seq_len(self) -> int | None:
        model = (self.plan.profile_meta.get("factory_options") or {}) if self.plan else {}
        seq = model.get("seq_len")
        return int(seq) if isinstance(seq, int) else None

    def _torchtitan(self) -> str:
        c, plan = self.best, self.plan
        assert plan is not None
        if c.placement != "tp,dp,pp":
            raise StageplanError("torchtitan's mesh puts the pipeline outermost (ParallelDims), and this "
                                 "layout places it inside the data-parallel groups: export megatron "
                                 "(--use-tp-pp-dp-mapping), or take the next layout in torchtitan's order")
        if c.sharding == "zero1":
            raise StageplanError("torchtitan has no zero1 (its data parallelism is DDP, FSDP or HSDP): lay "
                                 "out with --sharding ddp,fsdp for torchtitan, or export megatron")
        # a stage starts at each boundary's first module; torchtitan's LLaMA names blocks layers.N (HF:
        # model.layers.N)
        starts = [plan.layer_names[b].split("+")[0].removeprefix("model.") for b in plan.boundaries[1:-1]]
        lines = [f"# stageplan layout for torchtitan ({TORCHTITAN_RELEASE}); sequence parallelism comes with "
                 "tensor parallelism there",
                 "[parallelism]",
                 f"pipeline_parallel_degree = {c.pipeline_parallel}",
                 f"tensor_parallel_degree = {c.tensor_parallel}",
                 f"data_parallel_replicate_degree = {c.data_parallel if c.sharding == 'ddp' else 1}",
                 f"data_parallel_shard_degree = {c.data_parallel if c.sharding == 'fsdp' else 1}",
                 f'pipeline_parallel_schedule = "{c.schedule}"',
                 f"pipeline_parallel_microbatch_size = {c.microbatch_size}",
                 "pipeline_parallel_split_points = [" + ", ".join(f'"{x}"' for x in starts) + "]",
                 "",
                 "[training]",
                 f"local_batch_size = {c.microbatch_size * c.num_microbatches}",
                 f"global_batch_size = {self.global_batch_size}"]
        seq = self._seq_len()
        if seq:
            lines.append(f"seq_len = {seq}")
        lines += ["", "[activation_checkpoint]", f'mode = "{"full" if c.recompute else "none"}"']
        return "\n".join(lines)

    def _megatron(self) -> str:
        c, plan = self.best, self.plan
        assert plan is not None
        if c.sharding == "fsdp" and c.pipeline_parallel > 1:
            raise StageplanError("Megatron-LM's FSDP (--use-torch-fsdp2) does not run with pipeline "
                                 "parallelism: lay out with --sharding ddp,zero1 for Megatron")
        args = [f"--tensor-model-parallel-size {c.tensor_parallel}",
                f"--pipeline-model-parallel-size {c.pipeline_parallel}"]
        if c.pipeline_parallel > 1:
            args.append(f'--pipeline-model-parallel-layout "{plan.megatron_layout()}"')
        if c.sequence_parallel:
            args.append("--sequence-parallel")
        if c.placement == "tp,pp,dp":  # Megatron's default order is tp-cp-ep-dp-pp
            args.append("--use-tp-pp-dp-mapping")
        args += [f"--micro-batch-size {c.microbatch_size}", f"--global-batch-size {self.global_batch_size}"]
        if c.sharding == "zero1":
            args.append("--use-distributed-optimizer")
        if c.recompute:
            args += ["--recompute-granularity full", "--recompute-method uniform", "--recompute-num-layers 1"]
        return " \\\n  ".join(args)

    def _deepspeed(self) -> str:
        import json

        c, plan = self.best, self.plan
        assert plan is not None
        if c.tensor_parallel > 1:
            raise StageplanError("DeepSpeed's pipeline engine has no tensor parallelism here: lay out with "
                                 "--tensor-parallel 1 for DeepSpeed, or export megatron")
        if c.sharding == "fsdp":
            raise StageplanError("DeepSpeed's pipeline engine refuses ZeRO stage 2 and 3: lay out with "
                                 "--sharding ddp,zero1 for DeepSpeed")
        if c.virtual_stages > 1:
            raise StageplanError("DeepSpeed's pipeline engine runs one stage per rank: lay out with "
                                 "--schedule GPipe,1F1B for DeepSpeed")
        config = {"train_batch_size": self.global_batch_size,
                  "train_micro_batch_size_per_gpu": c.microbatch_size,
                  "gradient_accumulation_steps": c.num_microbatches,
                  "zero_optimization": {"stage": 1 if c.sharding == "zero1" else 0},
                  "bf16": {"enabled": self.options.get("precision") == "bf16-mixed"},
                  "pipeline": {"stages": c.pipeline_parallel, "partition_method": "custom",
                               "parts": plan.deepspeed_parts()}}
        if c.recompute:
            config["activation_checkpointing"] = {"partition_activations": False,
                                                  "contiguous_memory_optimization": False}
        return json.dumps(config, indent=1)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Layout:
        return cls.from_json(read_json(path, "layout"), source=str(path))
