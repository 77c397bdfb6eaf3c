"""The layout grid for N devices: pipeline x data x tensor degrees, microbatching, schedule, recompute and
sharding, each priced with the exact split inside; bounds first, the simulator on the best K (no torch).

How a candidate is priced (units: seconds, bytes):

- Its profile is the one measured or estimated at its microbatch size b and tensor-parallel degree t (a
  block's shard, with heads, key/value heads and the MLP divided by t), or one at another b scaled linearly
  (labelled). Tensor parallelism's all-reduces are added to each block's forward and backward
  (``sharding.tensor_parallel_block_s``); with sequence parallelism the boundary carries b*s*h/t and the
  norms' and residuals' saved inputs are divided by t.
- The split is the exact min-max split of ``solver.solve`` under the memory limit, with each layer's memory
  by sharding mode (``sharding.bytes_per_param``). Interleaved candidates are split chunk by chunk (the same
  solver over p*v chunks: a heuristic for the rank loads, which their bound still holds); an interleaved best
  then gets the rank-level MILP within a node budget (``MILP_NODE_LIMIT``), its split kept where it simulates
  faster, and its proven gap in the layout's notes.
- The step, in closed form: (m + (p-1)/v) x the slowest rank's time per microbatch (Narayanan et al. 2021,
  section 2.2: the bubble is (p-1)/v of a microbatch's pass), plus the slowest rank's exposed data-parallel
  sync and optimizer step and the tied all-reduce. The best ``top`` within ``BAND`` of the best are then
  simulated over torch's order (``costs.evaluate``) and ranked by the simulated step.
- Bounds, valid before any split (``lower_bounds``, ``split_memory_bounds``; tested against every split of
  small models): the step is at least (m + (p-1)/v) x the slowest rank's least time per microbatch (the mean
  rank's, the largest layer's, the ceil(L/p) quickest layers' that some rank holds, each with the cheapest
  boundary's transfers; with one chunk a rank, the solver's least bottleneck without memory rows), and the
  fullest device at least a closed form (the mean and the largest layer) and the split bound (a weighted mean
  of the ranks, minimised over every split by a dynamic programme). A candidate is priced only if its memory
  bound is within the limit and its step bound at most the ``top``-th best step found so far (best-first by
  bound), so the first ``top`` candidates by step, and the simulator's ranking of those within ``BAND`` of the
  best, are those pricing every candidate (``bounds=False``) finds: the same best and the same ranking.
"""

from __future__ import annotations

import heapq
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from importlib import resources
from typing import Any

import numpy as np

from stageplan.errors import InfeasiblePlanError, StageplanError
from stageplan.formats.layout import Candidate, Layout
from stageplan.formats.profile import Profile
from stageplan.formats.schedule import check_microbatches, normalize_schedule
from stageplan.planning.costs import (
    CostOptions,
    LayerArrays,
    data_parallel_sync_s,
    evaluate,
    make_options,
    memory_terms,
    optimizer_time,
    rank_peak_activation_bytes,
    solver_inputs,
    tied_sync_time,
)
from stageplan.planning.planner import make_plan
from stageplan.planning.schedules import ScheduleShape, counts_shape, warmup_counts
from stageplan.planning.sharding import (
    OPTIMIZER_STATES,
    PRECISIONS,
    SHARDINGS,
    bytes_per_param,
    check_sharding,
    tensor_parallel_block_s,
    tensor_parallel_collectives,
    zero1_shares,
)
from stageplan.planning.solver import solve
from stageplan.units import format_bytes

# The default grid (docs/cost-model.md, `stageplan layout --help`).
DEFAULT_TENSOR_PARALLEL = (1, 2, 4, 8)
DEFAULT_MICROBATCH_SIZES = (1, 2, 4, 8)
DEFAULT_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B")
DEFAULT_RECOMPUTE = (False, True)
LAYOUT_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B")
# The simulator ranks the candidates whose closed-form step is within this fraction of the best closed-form
# step (at most --top of them): the closed form and the simulated step of one candidate differed by up to 6%
# on LLaMA-70B's interleaved candidates. Every one of the first --top candidates by step is priced with and
# without the bounds (a candidate is pruned only above the --top-th step found), so the choice and the ranking
# are the same.
BAND = 0.05
# A memory bound prunes a candidate only above the limit by this fraction: the bounds sum the same bytes in
# another order than the pricing does (float64 rounding, about 1e-16 relative a term)
MEMORY_RTOL = 1e-9
# The rank-level MILP (interleaved.solve_interleaved, HiGHS) on an interleaved best is budgeted in
# branch-and-bound nodes, not seconds, so that the same input gives the same layout on any machine (an
# iteration limit, not a wall-clock one). Its time limit is set far beyond what these nodes take (2.5
# s on the LLaMA-3-70B 512-device best, 28 chunks, on a loaded 2-core host), so that on any working machine
# the answer depends on the node limit alone. 20 nodes: there 20 and 200 nodes prove the same bound (the
# split within 0.04% of it), in 2.5 s against 6.7 s.
MILP_NODE_LIMIT = 20
MILP_TIME_LIMIT_S = 600.0


@dataclass(frozen=True)
class Network:
    """The devices' links, per GPU and one way (``sharding`` module docstring): within a node and across
    nodes, and the per-message latency of every collective and transfer."""

    devices_per_node: int
    intra_node_bytes_per_s: float
    inter_node_bytes_per_s: float
    latency_s: float = 0.0
    # a measured all-reduce of replicas within a node (layout --link: costs.data_parallel_link), as the ring
    # model's per-link bandwidth and per-step latency; None: the replicas' sync uses the links above
    dp_bandwidth_bytes_per_s: float | None = None
    dp_latency_s: float = 0.0
    # each sharding mode's own sync as the link timed it ((kind, fixed_s, bytes_per_s) rows: costs.CostOptions
    # dp_sync_fit), over dp_sync_ranks replicas within a node: it prices candidates of that d only
    dp_sync_fit: tuple[tuple[str, float, float], ...] = ()
    dp_sync_ranks: int = 0

    def bandwidth(self, spans_nodes: bool) -> float:
        return self.inter_node_bytes_per_s if spans_nodes else self.intra_node_bytes_per_s

    def data_parallel(self, spans_nodes: bool) -> tuple[float, float]:
        """(bandwidth, latency) of the replicas' ring: the measured all-reduce within a node where there is
        one (a local probe says nothing of a link across nodes), else the network's link."""
        if self.dp_bandwidth_bytes_per_s is not None and not spans_nodes:
            return self.dp_bandwidth_bytes_per_s, self.dp_latency_s
        return self.bandwidth(spans_nodes), self.latency_s


# _grid's choices besides the search: tensor degrees, pipeline degrees (None: all), microbatch sizes,
# schedules, virtual stages (None: all), recompute settings, shardings
_GridArgs = tuple[Sequence[int], Sequence[int] | None, Sequence[int], Sequence[str], Sequence[int] | None,
                  Sequence[bool], Sequence[str]]


@dataclass(frozen=True)
class _Point:
    """One grid point before pricing."""

    t: int
    p: int
    d: int
    b: int
    m: int
    schedule: str
    v: int
    recompute: bool
    sharding: str
    # innermost to outermost: tensor, data, pipeline (torchtitan's ParallelDims), or pipeline inside data
    placement: str = "tp,dp,pp"


@dataclass
class _Prepared:
    """A (b, t) profile with tensor parallelism priced in, and what the bounds need from it."""

    profile: Profile
    scaled_from: int | None
    tp_s: np.ndarray  # per layer, tensor-parallel seconds per microbatch (forward + backward), no recompute
    tp_forward_s: np.ndarray


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _layout_model(profile: Profile) -> dict[str, Any] | None:
    """The model's shape for tensor parallelism's traffic and MFU (:func:`layout_model_of`), its parameters
    summed over the profile's layers."""
    return layout_model_of(profile.meta, float(sum(x.param_count for x in profile.layers)))


def layout_model_of(meta: Mapping[str, Any], params: float) -> dict[str, Any] | None:
    """The model's shape for tensor parallelism's traffic and MFU: ``meta["layout_model"]`` (written with the
    layout's own estimates), else read off an HF preset's profile meta (its preset's hidden size, its
    sequence, its blocks) with ``params`` parameters; None for other models."""
    model = meta.get("layout_model")
    if isinstance(model, dict):
        return model
    options = meta.get("factory_options") or {}
    preset, seq = options.get("preset"), options.get("seq_len")
    if not isinstance(preset, str) or not isinstance(seq, int):
        return None
    path = resources.files("stageplan").joinpath(f"presets/{preset}.json")
    if not path.is_file():
        return None
    fields = json.loads(path.read_text(encoding="utf-8"))
    element = 2 if str(meta.get("dtype")) in ("bfloat16", "float16") else 4
    return {"params": float(params), "num_layers": len(meta.get("named_layers") or ()),
            "hidden_size": int(fields["hidden_size"]), "seq_len": seq, "activation_element_bytes": element}


def _block_mask(profile: Profile) -> np.ndarray:
    """Which layers are the model's named blocks (the transformer blocks tensor parallelism splits)."""
    named = set(profile.meta.get("named_layers") or ())
    return np.array([x.name in named for x in profile.layers], dtype=bool)


def prepare_profile(profile: Profile, t: int, network: Network, *, sequence_parallel: bool = False,
                    scaled_from: int | None = None) -> _Prepared:
    """The profile of a t-way shard with its tensor-parallel communication priced into each block's forward
    and backward; with sequence parallelism, each block's boundary divided by t and its norms' and residuals'
    saved inputs too (Korthikanti et al. 2022, section 4.2.2: the two norms' inputs and outputs, 4 x b*s*h
    elements a block, are what sequence parallelism shards; a shard profiled at the full sequence counts them
    whole)."""
    L = len(profile)
    zeros = np.zeros(L)
    if t <= 1:
        return _Prepared(profile, scaled_from, zeros, zeros)
    model = _layout_model(profile)
    if model is None:
        raise StageplanError(
            f"tensor parallelism (t = {t}) needs a profile of the t-way shard with the model's shape "
            "(meta layout_model): make it with stageplan layout MODEL --device estimate:GPU, or use t = 1")
    blocks = _block_mask(profile)
    b = int(profile.meta.get("microbatch_size") or 1)
    tokens, hidden = b * int(model["seq_len"]), int(model["hidden_size"])
    elem = float(model.get("activation_element_bytes", 2))
    fwd, bwd = tensor_parallel_block_s(tokens, hidden, elem, t, network.intra_node_bytes_per_s,
                                       network.latency_s)
    layers = []
    for i, x in enumerate(profile.layers):
        if not blocks[i]:
            layers.append(x)
            continue
        act, out = x.activation_bytes, x.output_bytes
        if sequence_parallel:
            act = max(0, int(act - (1 - 1 / t) * 4 * tokens * hidden * elem))
            out = int(out / t)
        layers.append(replace(x, forward_s=x.forward_s + fwd, backward_s=x.backward_s + bwd,
                              backward_accumulate_s=None if x.backward_accumulate_s is None
                              else x.backward_accumulate_s + bwd, activation_bytes=act, output_bytes=out))
    if sequence_parallel:  # the embedding's output is the first block's input: sharded the same way
        first = int(np.argmax(blocks)) if blocks.any() else 0
        if first > 0:
            x = layers[first - 1]
            layers[first - 1] = replace(x, output_bytes=int(x.output_bytes / t))
    tp = np.where(blocks, fwd + bwd, 0.0)
    return _Prepared(Profile(tuple(layers), dict(profile.meta)), scaled_from, tp,
                     np.where(blocks, fwd, 0.0))


def scale_profile(profile: Profile, b: int) -> Profile:
    """``profile`` (measured at its own microbatch size) at microbatch size ``b``: times and activation and
    boundary bytes linear in the batch (an extrapolation, labelled on the candidate)."""
    b0 = int(profile.meta.get("microbatch_size") or 1)
    f = b / b0
    layers = tuple(replace(x, forward_s=x.forward_s * f, backward_s=x.backward_s * f,
                           backward_accumulate_s=None if x.backward_accumulate_s is None
                           else x.backward_accumulate_s * f, activation_bytes=int(x.activation_bytes * f),
                           output_bytes=int(x.output_bytes * f)) for x in profile.layers)
    return Profile(layers, {**profile.meta, "microbatch_size": b})


def _peak_flops(profile: Profile) -> float | None:
    """The estimated GPU's dense bf16 peak (gpus.json), for MFU; None for a measured profile."""
    gpu = (profile.meta.get("estimate") or {}).get("gpu")
    if not gpu:
        return None
    table = json.loads(resources.files("stageplan").joinpath("gpus.json").read_text(encoding="utf-8"))
    row = table["gpus"].get(str(gpu).lower())
    return None if row is None else float(row["peak_flops"]["bf16"])


def model_flops_per_token(model: Mapping[str, Any], recompute: bool = False) -> float:
    """Training FLOPs per token: 6N + 12 x layers x hidden x seq (PaLM, Chowdhery et al. 2022, appendix B: the
    matmuls of N parameters forward and backward, plus attention's). With full recompute the hardware runs the
    forward again: 8N + 16 x layers x hidden x seq (hardware FLOPs, for HFU).

    >>> model_flops_per_token({"params": 1e9, "num_layers": 10, "hidden_size": 1000, "seq_len": 100})
    6012000000.0
    """
    n, attn = float(model["params"]), float(model["num_layers"]) * float(model["hidden_size"]) * float(
        model["seq_len"])
    return (8 * n + 16 * attn) if recompute else (6 * n + 12 * attn)


@dataclass
class _Search:
    """The state of one search: inputs, caches and counts."""

    profiles: dict[tuple[int, int], _Prepared]
    num_devices: int
    global_batch_size: int
    network: Network
    memory_limit_bytes: float | None
    precision: str
    grad_dtype: str
    optimizer: str
    sequence_parallel: bool = False
    free_splits: dict[tuple[Any, ...], tuple[tuple[int, ...], float]] = field(default_factory=dict)
    # the least-bottleneck split under the memory rows, or None where none fits (``_split``)
    limited_splits: dict[tuple[Any, ...], tuple[int, ...] | None] = field(default_factory=dict)
    # the schedules' counts (schedules.counts_shape) per (schedule, p, m, v): shared by the shardings and
    # recompute settings of one schedule, which a search prices one after another
    shapes: dict[tuple[str, int, int, int], ScheduleShape] = field(default_factory=dict)

    def arrays(self, b: int, t: int, m: int, cache: dict[tuple[int, int, int], LayerArrays]) -> LayerArrays:
        key = (b, t, m)
        if key not in cache:
            cache[key] = LayerArrays.of(self.profiles[(b, t)].profile, m)
        return cache[key]

    def spans(self, pt: _Point) -> dict[str, bool]:
        """Which groups span nodes: a group spans nodes when its ranks lie more than a node apart. With tensor
        innermost, then data, then pipeline (torchtitan's ParallelDims order), a data group spans t x d ranks
        and a pipeline t x d x p; with the pipeline inside the data groups, t x p and t x p x d."""
        n = self.network.devices_per_node
        if pt.placement == "tp,pp,dp":
            return {"tp": pt.t > n, "pp": pt.p > 1 and pt.t * pt.p > n,
                    "dp": pt.d > 1 and pt.t * pt.p * pt.d > n}
        return {"tp": pt.t > n, "dp": pt.d > 1 and pt.t * pt.d > n, "pp": pt.p > 1 and pt.t * pt.d * pt.p > n}

    def options(self, pt: _Point, arr_profile: Profile, full: bool = False) -> CostOptions:
        """The candidate's cost options; for pricing (``full`` False) with the schedule's counts only
        (``schedules.counts_shape``), for the simulator with torch's whole order."""
        spans = self.spans(pt)
        dp_bandwidth, dp_latency = self.network.data_parallel(spans["dp"])
        return make_options(arr_profile, pt.p, num_microbatches=pt.m, schedule=pt.schedule,
                            virtual_stages=pt.v, optimizer=self.optimizer,
                            memory_limit_bytes=self.memory_limit_bytes, recompute=pt.recompute,
                            precision=self.precision,
                            bandwidth_bytes_per_s=self.network.bandwidth(spans["pp"]),
                            link_latency_s=self.network.latency_s, data_parallel=pt.d, sharding=pt.sharding,
                            grad_dtype=self.grad_dtype,
                            dp_bandwidth_bytes_per_s=dp_bandwidth, dp_latency_s=dp_latency,
                            dp_sync_fit=(self.network.dp_sync_fit
                                         if pt.d == self.network.dp_sync_ranks and not spans["dp"] else None),
                            shape=None if full else self.counts(pt))

    def free_split(self, arr: LayerArrays, pt: _Point, bandwidth: float | None
                   ) -> tuple[tuple[int, ...], float]:
        """The least-bottleneck split of the candidate's p x v chunks without memory rows, and its bottleneck
        (seconds per microbatch of the slowest chunk, within the solver's 1e-12): one solve per time problem
        (the arrays, the chunks, recompute and the pipeline's link), shared by the shardings. Its inputs are
        ``costs.solver_inputs``' time rows: ``layer_time`` and twice ``comm_time`` (each boundary both
        ways), every device at speed 1."""
        key = (id(arr), pt.p, pt.v, pt.recompute, bandwidth)
        if key not in self.free_splits:
            S = pt.p * pt.v
            costs = arr.forward_s * (2.0 if pt.recompute else 1.0) + arr.backward_s
            comm = (arr.output_bytes / bandwidth if bandwidth is not None
                    else np.zeros_like(arr.output_bytes))
            sol = solve(costs, S, stage_speeds=np.ones(S), boundary_costs=2.0 * comm, tie_break=False)
            self.free_splits[key] = (tuple(sol.boundaries), sol.bottleneck)
        return self.free_splits[key]

    def counts(self, pt: _Point) -> ScheduleShape:
        key = (pt.schedule, pt.p, pt.m, pt.v)
        if key not in self.shapes:
            self.shapes[key] = counts_shape(*key)
        return self.shapes[key]


def _min_inflight(schedule: str, m: int) -> int:
    """The fewest microbatches any stage holds at its peak: every one under GPipe; one on 1F1B's last stage
    and interleaved's last chunk."""
    return m if schedule == "GPipe" else 1


def lower_bounds(arr: LayerArrays, pt: _Point, per_param_bytes: float,
                 link_bytes_per_s: float | None = None) -> tuple[float, float]:
    """(step, fullest device's memory) no split of this candidate can beat (module docstring), with the
    pipeline's boundaries priced over ``link_bytes_per_s`` (None: not priced).

    >>> from stageplan.formats.profile import LayerProfile, Profile
    >>> prof = Profile(tuple(LayerProfile(f"l{i}", 1.0, 2.0, 10, 1, 0) for i in range(4)))
    >>> lower_bounds(LayerArrays.of(prof), _Point(1, 2, 1, 1, 4, "1F1B", 1, False, "ddp"), 0.0)
    (30.0, 26.666666666666668)
    """
    lt = arr.forward_s * (2.0 if pt.recompute else 1.0) + arr.backward_s
    L, S = len(lt), pt.p * pt.v
    # every chunk but the last sends its output and receives its gradient: 2 x (the cheapest boundary) each,
    # on its rank (``price``); a rank holds v chunks, so at least v - 1 of them
    hop = (2.0 * float((arr.output_bytes[:L - 1] / link_bytes_per_s).min())
           if link_bytes_per_s is not None and L > 1 else 0.0)
    # the mean rank; the rank of the largest layer; a rank holding at least ceil(L / p) layers (some rank
    # does), so at least the ceil(L / p) quickest layers' time
    fewest = -(-L // pt.p)
    per_mb = max((float(lt.sum()) + (S - 1) * hop) / pt.p,
                 max(float(lt.max()), float(np.sort(lt)[:fewest].sum())) + (pt.v - 1) * hop)
    step = (pt.m + (pt.p - 1) / pt.v) * per_mb
    static = arr.param_count * per_param_bytes
    # recomputed, a stage holds one microbatch's activations of all its layers while it recomputes them (a
    # rank of v chunks, of one chunk at a time: at least 1/v of its layers' on average)
    acts = (arr.activation_bytes / pt.v if pt.recompute
            else arr.activation_bytes * _min_inflight(pt.schedule, pt.m))
    memory = max(float((static + acts).sum()) / pt.p, float((static + acts).max()))
    if pt.schedule == "1F1B" and not pt.recompute and pt.p > 1:
        # weighting stage s by 1/f_s, f_s = min(p - s, m) in flight (1F1B): max_s M_s >= sum_s (static_s / f_s
        # + act_s) / sum_s 1/f_s >= (total static / max f + total activations) / sum_s 1/f_s
        f = np.minimum(np.arange(pt.p, 0, -1), pt.m)
        memory = max(memory, (float(static.sum()) / float(f.max()) + float(arr.activation_bytes.sum()))
                     / float((1.0 / f).sum()))
    return step, memory


def split_memory_bounds(items: Sequence[tuple[LayerArrays, _Point, float]]) -> list[float]:
    """For each (arrays, candidate, bytes per parameter): a memory no split of the candidate can keep its
    fullest device under, from the cost model's own terms (``costs.memory_terms``, ``_rank_memory``).

    Rank r holds, over its chunks c, the static bytes of their layers, each chunk's send/receive buffers
    (2 x the boundary's output, ``memory_terms``), zero1's imbalance (>= 0, dropped here) and its
    activations: without recompute the largest sum_c counts[c] x (chunk c's saved bytes) over the moments of
    its order, so at least the sum at one moment, the end of its warm-up (``schedules.warmup_counts``: k_c);
    with recompute each chunk's saved bytes once plus its peak in flight (>= k_c) x its input. So for weights
    w_r >= 0 summing to 1, max_r M_r >= sum_r w_r M_r >= sum over chunks c of w_r(c) x (sum over its layers
    of static + k_c x saved, plus its boundary terms), which is linear in the split: its minimum over every
    split into p x v non-empty chunks is a dynamic programme over (chunk, boundary), O(p v L) (a prefix
    minimum per chunk). Two weightings are tried: uniform (the mean rank), and w_r proportional to 1 / (the
    cost of the whole model on rank r's cheapest chunk), so that piling the layers onto the chunk holding the
    fewest microbatches (1F1B's and interleaved's last) costs as much as anywhere else (1F1B's 1 / f_s
    weighting, for every schedule). Candidates with the same number of chunks are solved together."""
    out = [0.0] * len(items)
    groups: dict[int, list[tuple[Any, ...]]] = {}
    counted: dict[tuple[str, int, int, int], np.ndarray] = {}
    layers: dict[tuple[int, float], tuple[np.ndarray, np.ndarray, np.ndarray, float, float]] = {}
    for n, (arr, pt, per) in enumerate(items):
        S = pt.p * pt.v
        shape = (pt.schedule, pt.p, pt.m, pt.v)
        if shape not in counted:
            counted[shape] = warmup_counts(*shape)
        counts = counted[shape]
        if (id(arr), per) not in layers:
            static = arr.param_count * per
            act = np.asarray(arr.activation_bytes, dtype=float)
            layers[(id(arr), per)] = (np.concatenate([[0.0], np.cumsum(static)]),
                                      np.concatenate([[0.0], np.cumsum(act)]),
                                      # before[j] = out[j - 1]
                                      np.concatenate([[0.0], np.asarray(arr.output_bytes, dtype=float)]),
                                      float(static.sum()), float(act.sum()))
        pre_static, pre_act, before, total_static, total_act = layers[(id(arr), per)]
        saved = np.ones(S) if pt.recompute else counts
        start = counts if pt.recompute else np.zeros(S)
        # chunk c = k p + r (placement_of for GPipe, 1F1B and Interleaved1F1B): rank r's chunks are column r
        cheapest = (total_static + saved * total_act).reshape(pt.v, pt.p).min(axis=0)
        weights = [np.full(pt.p, 1.0 / pt.p)]
        if cheapest.min() > 0 and not np.all(cheapest == cheapest[0]):
            harmonic = 1.0 / cheapest
            weights.append(harmonic / harmonic.sum())
        for w in weights:
            groups.setdefault(S, []).append((n, np.tile(w, pt.v), saved, start, pre_static, pre_act, before))
    for S, rows in groups.items():
        idx = [r[0] for r in rows]
        wc, saved, start, ps, pa, before = (np.stack([r[k] for r in rows]) for k in range(1, 7))
        L = ps.shape[1] - 1
        cost = wc[:, :1] * (ps + saved[:, :1] * pa)  # chunk 0 over [0, j)
        cost[:, 0] = np.inf
        for c in range(1, S):
            g = wc[:, c:c + 1] * (ps + saved[:, c:c + 1] * pa)
            # chunk c starts at i: chunk c - 1's buffers and chunk c's input in flight (recompute) at i
            val = cost + (2.0 * wc[:, c - 1:c] + start[:, c:c + 1] * wc[:, c:c + 1]) * before - g
            val[:, :c] = np.inf
            best = np.minimum.accumulate(val, axis=1)
            cost = np.full_like(val, np.inf)
            cost[:, c + 1:] = g[:, c + 1:] + best[:, c:L]
        for n, value in zip(idx, cost[:, L], strict=True):
            out[n] = max(out[n], float(value))
    return out


def _tighten(search: _Search, bounded: list[tuple[float, float, _Point]],
             arrays: dict[tuple[int, int, int], LayerArrays], which: Any
             ) -> list[tuple[float, float, _Point]]:
    """``bounded`` with each memory bound for which ``which(bound)`` holds raised to its split bound
    (:func:`split_memory_bounds`), computed once per distinct memory problem: zero1 and fsdp hold the same
    bytes per parameter on average, so they share one."""
    keys: dict[tuple[Any, ...], int] = {}
    items: list[tuple[LayerArrays, _Point, float]] = []
    todo = []
    for n, (_, mem, pt) in enumerate(bounded):
        if not which(mem):
            continue
        per = bytes_per_param(search.precision, search.optimizer, pt.sharding, pt.d, search.grad_dtype).total
        key = (pt.b, pt.t, pt.p, pt.m, pt.schedule, pt.v, pt.recompute, per)
        if key not in keys:
            keys[key] = len(items)
            items.append((search.arrays(pt.b, pt.t, pt.m, arrays), pt, per))
        todo.append((n, keys[key]))
    floors = split_memory_bounds(items)
    out = list(bounded)
    for n, k in todo:
        step, mem, pt = out[n]
        out[n] = (step, max(mem, floors[k]), pt)
    return out


def _grid(search: _Search, L: int, tensor_parallel: Sequence[int], pipeline_parallel: Sequence[int] | None,
          microbatch_sizes: Sequence[int],
          schedules: Sequence[str], virtual_stages: Sequence[int] | None, recompute: Sequence[bool],
          shardings: Sequence[str], rejected: dict[str, dict[str, Any]]) -> list[_Point]:
    """Every grid point p x d x t = N, b x m x d = B that torch's schedules accept; the families left out, in
    ``rejected``."""
    N, B = search.num_devices, search.global_batch_size
    points = []
    for t in tensor_parallel:
        if N % t:
            continue
        if not any((b, t) in search.profiles for b in microbatch_sizes):
            continue
        for p in _divisors(N // t):
            if pipeline_parallel is not None and p not in pipeline_parallel:
                continue
            if p > L:
                _reject(rejected, f"tp{t} pp{p}", "rule", f"more stages than the {L} layers")
                continue
            d = N // (t * p)
            for b in microbatch_sizes:
                if (b, t) not in search.profiles:
                    continue
                if B % (b * d):
                    _reject(rejected, f"tp{t} pp{p} dp{d}", "rule",
                            f"the global batch {B} is not a multiple of b x dp at b = {b}")
                    continue
                m = B // (b * d)
                for sched in schedules:
                    vs = [1]
                    if sched == "Interleaved1F1B":
                        if p == 1:
                            continue
                        vs = [v for v in (virtual_stages or range(2, L // p + 1)) if v >= 2 and p * v <= L]
                    for v in vs:
                        try:
                            check_microbatches(sched, p, m, v)
                        except StageplanError:
                            _reject(rejected, f"tp{t} pp{p} dp{d}", "rule",
                                    f"torch's {sched} refuses m = {m} (v = {v})")
                            continue
                        for rc in recompute:
                            for sh in (shardings if d > 1 else ("ddp",)):
                                points.append(_Point(t, p, d, b, m, sched, v, rc, sh))
    return points


def _reject(rejected: dict[str, dict[str, Any]], family: str, kind: str, rule: str | None = None,
            over_bytes: float | None = None, step_bound_s: float | None = None) -> None:
    """Count a rejected candidate in its family (its tp, pp and dp): by ``kind`` "memory" (the least excess
    over the limit any of them showed), "time" (the least step bound of those pruned by it) or "rule" (which
    rules)."""
    row = rejected.setdefault(family, {"family": family, "memory": 0, "time": 0, "rule": 0})
    row[kind] += 1
    if rule is not None and rule not in row.setdefault("rules", []):
        row["rules"].append(rule)
    if over_bytes is not None and math.isfinite(over_bytes):
        row["least_over_bytes"] = min(row.get("least_over_bytes", math.inf), over_bytes)
    if step_bound_s is not None:
        row["least_step_bound_s"] = min(row.get("least_step_bound_s", math.inf), step_bound_s)


def _split(search: _Search, arr: LayerArrays, pt: _Point, opts: CostOptions, fits: Any) -> tuple[int, ...]:
    """The exact min-max split under the memory limit (per chunk for interleaved candidates, each chunk under
    its rank's limit, then checked per rank). The split without memory rows (``_Search.free_split``) is kept
    where it fits (``fits``): it is then optimal under the limit as well; else one solve with the memory rows
    answers both whether any split fits (its first probe; ``InfeasiblePlanError`` without the smallest limit
    where none does) and the least bottleneck under the limit."""
    inp = solver_inputs(arr, opts)
    limits = inp["limits"]
    free, _ = search.free_split(arr, pt, opts.bandwidth_bytes_per_s)
    if limits is None or fits(free, inp["memory_bytes"], inp["memory_start_bytes"], inp["memory_end_bytes"]):
        return free
    # the memory rows are bytes per parameter by kind (costs.memory_terms) and the schedule's counts: zero1
    # and fsdp hold the same of each kind, so their solves are one
    per = bytes_per_param(search.precision, search.optimizer, pt.sharding, pt.d, search.grad_dtype)
    key = (id(arr), pt.p, pt.v, pt.recompute, opts.bandwidth_bytes_per_s, opts.shape.peak_inflight,
           per.weights, per.grads, per.master, per.optimizer, search.memory_limit_bytes)
    if key not in search.limited_splits:
        try:
            sol = solve(inp["costs"], opts.num_chunks, stage_speeds=inp["speeds"],
                        boundary_costs=inp["boundary_costs"], tie_break=False, min_limit=False,
                        memory_bytes=inp["memory_bytes"], memory_start_bytes=inp["memory_start_bytes"],
                        memory_end_bytes=inp["memory_end_bytes"],
                        memory_limit_bytes=limits if opts.virtual_stages == 1
                        else limits[np.asarray(opts.shape.stage_ranks)])
            search.limited_splits[key] = tuple(sol.boundaries)
        except InfeasiblePlanError:
            search.limited_splits[key] = None
    found = search.limited_splits[key]
    if found is None:
        raise InfeasiblePlanError("no split fits the memory limit")
    return found


def _zero1_extra(
    profile: Profile, boundaries: Sequence[int], opts: CostOptions
) -> tuple[list[float], str | None]:
    """Per rank, the bytes the fullest replica holds beyond the 1/d average under zero1's partition of whole
    tensors (``sharding.zero1_shares``), from the profile's per-layer tensor sizes (meta param_tensors); zeros
    and a note where the profile lists none."""
    p, d = opts.num_ranks, opts.data_parallel
    if opts.sharding != "zero1" or d <= 1 or opts.precision is None:
        return [0.0] * p, None
    tensors = profile.meta.get("param_tensors")
    if not isinstance(tensors, list) or len(tensors) != len(profile):
        return [0.0] * p, ("zero1's partition of whole tensors is taken as 1/d: the profile lists no tensor "
                           "sizes (meta param_tensors)")
    per = bytes_per_param(opts.precision, opts.optimizer, "zero1", d, opts.grad_dtype)
    sharded_per_elem = (per.master + per.optimizer) * d  # bytes per element of an owned tensor
    ranks = opts.shape.stage_ranks
    out = []
    for r in range(p):
        numels = [n for s in range(len(boundaries) - 1) if ranks[s] == r
                  for layer in range(boundaries[s], boundaries[s + 1]) for n in tensors[layer]]
        if not numels:
            out.append(0.0)
            continue
        shares = zero1_shares(numels, d)
        out.append((max(shares) - sum(numels) / d) * sharded_per_elem)
    return out, None


def price(search: _Search, pt: _Point, prepared: _Prepared, arr: LayerArrays, opts: CostOptions,
          boundaries: Sequence[int], lower_step_s: float) -> Candidate:
    """The closed-form step, its parts and the fullest device's memory for a split (module docstring)."""
    L = len(arr.forward_s)
    b = np.asarray(boundaries)
    S, p = opts.num_chunks, opts.num_ranks
    ranks = np.asarray(opts.shape.stage_ranks)
    lt = arr.forward_s * (2.0 if pt.recompute else 1.0) + arr.backward_s
    tp = prepared.tp_s + (prepared.tp_forward_s if pt.recompute else 0.0)
    comm = arr.output_bytes / opts.bandwidth_bytes_per_s if opts.bandwidth_bytes_per_s else np.zeros(L)
    pre_lt, pre_tp = np.concatenate([[0.0], np.cumsum(lt)]), np.concatenate([[0.0], np.cumsum(tp)])
    chunk_time = pre_lt[b[1:]] - pre_lt[b[:-1]]
    chunk_tp = pre_tp[b[1:]] - pre_tp[b[:-1]]
    chunk_comm = np.array([2.0 * comm[b[s + 1] - 1] if b[s + 1] < L else 0.0 for s in range(S)])
    rank_time = np.bincount(ranks, chunk_time + chunk_comm, minlength=p)
    slowest = int(np.argmax(rank_time))
    per_mb = float(rank_time[slowest])
    mine = ranks == slowest
    # once per step, after the last backward: the optimizer (1/d of it under zero1 and fsdp), the replicas'
    # sync and the tied all-reduce
    opt_layer = optimizer_time(arr, opts) / (pt.d if pt.sharding != "ddp" else 1)
    pre_opt = np.concatenate([[0.0], np.cumsum(opt_layer)])
    rank_opt = np.bincount(ranks, pre_opt[b[1:]] - pre_opt[b[:-1]], minlength=p)
    sync = np.array(data_parallel_sync_s(arr, boundaries, opts))
    tied = float(tied_sync_time(arr, b[None, :], opts)[0])
    tail = int(np.argmax(rank_opt + sync))
    step = (pt.m + (pt.p - 1) / pt.v) * per_mb + float(rank_opt[tail] + sync[tail]) + tied
    parts = {"compute_s": pt.m * float((chunk_time - chunk_tp)[mine].sum()),
             "bubble_s": (pt.p - 1) / pt.v * per_mb,
             "pipeline_transfer_s": pt.m * float(chunk_comm[mine].sum()) + tied,
             "dp_sync_s": float(sync[tail]), "tp_comm_s": pt.m * float(chunk_tp[mine].sum()),
             "optimizer_s": float(rank_opt[tail])}
    memory, by_kind = _rank_memory(search, prepared.profile, arr, boundaries, opts)
    fullest = int(np.argmax(memory))
    return _candidate(search, pt, prepared, boundaries, step, lower_step_s, memory, by_kind[fullest], parts)


def _rank_memory(search: _Search, profile: Profile, arr: LayerArrays, boundaries: Sequence[int],
                 opts: CostOptions) -> tuple[list[float], list[dict[str, float]]]:
    terms = memory_terms(arr, opts)
    ranks = opts.shape.stage_ranks
    p = opts.num_ranks
    by_kind: list[dict[str, float]] = [dict.fromkeys(terms, 0.0) for _ in range(p)]
    for s in range(len(boundaries) - 1):
        for kind, term in terms.items():
            if kind != "activations" or opts.recompute:
                by_kind[ranks[s]][kind] += term.stage(s, int(boundaries[s]), int(boundaries[s + 1]))
    if not opts.recompute:
        for r, peak in enumerate(rank_peak_activation_bytes(arr, boundaries, opts.shape)):
            by_kind[r]["activations"] = peak
    extra, _ = _zero1_extra(profile, boundaries, opts)
    for r in range(p):
        by_kind[r]["zero1_imbalance"] = extra[r]
    return [sum(k.values()) for k in by_kind], by_kind


def _candidate(search: _Search, pt: _Point, prepared: _Prepared, boundaries: Sequence[int] | None,
               step: float, lower_step_s: float, memory: Sequence[float], by_kind: Mapping[str, float],
               parts: Mapping[str, float]) -> Candidate:
    limit = search.memory_limit_bytes
    peak = max(memory)
    tps, mfu, hfu = _rates(search, prepared, pt, step)
    spans = tuple(k for k, v in search.spans(pt).items() if v)
    over = limit is not None and peak > limit * (1 + 1e-12)
    return Candidate(pt.t, pt.p, pt.d, pt.b, pt.m, pt.schedule, pt.v, pt.recompute, pt.sharding,
                     search.sequence_parallel and pt.t > 1,
                     None if boundaries is None else tuple(int(x) for x in boundaries), step, None,
                     lower_step_s,
                     peak, dict(by_kind), tuple(float(x) for x in memory), dict(parts), tps, mfu, hfu,
                     not over, (f"fullest device {format_bytes(peak)}, over the limit by "
                                f"{format_bytes(peak - limit)}" if over and limit is not None else None),
                     prepared.scaled_from, spans, pt.placement)


def _rates(search: _Search, prepared: _Prepared, pt: _Point, step: float
           ) -> tuple[float | None, float | None, float | None]:
    """Tokens per second per device, MFU and HFU (an estimate's, against its GPU's dense bf16 peak) of a step
    of ``step`` seconds; None where the profile does not give the model's shape or the GPU."""
    model = _layout_model(prepared.profile)
    tokens = search.global_batch_size * int(model["seq_len"]) if model else None
    if not tokens or not (0 < step < math.inf):
        return None, None, None
    tps = tokens / step / search.num_devices
    peak_flops = _peak_flops(prepared.profile)
    if not model or not peak_flops or "params" not in model:
        return tps, None, None
    denominator = step * search.num_devices * peak_flops
    return (tps, model_flops_per_token(model) * tokens / denominator,
            model_flops_per_token(model, pt.recompute) * tokens / denominator)


@dataclass(frozen=True)
class _MilpRun:
    """What the rank-level MILP found for one interleaved candidate: its split's slowest rank (seconds per
    microbatch, the MILP's objective), the proven lower bound on it, the nodes HiGHS solved, and whether its
    split replaced the chunk-by-chunk one (simulated faster)."""

    bottleneck: float
    lower_bound: float
    nodes: int
    kept: bool

    @property
    def gap(self) -> float:
        return self.bottleneck / self.lower_bound - 1 if self.lower_bound > 0 else math.inf

    @property
    def nodes_text(self) -> str:
        return f"{self.nodes} node{'' if self.nodes == 1 else 's'}"


def _milp_split(search: _Search, c: Candidate, arrays: dict[tuple[int, int, int], LayerArrays]
                ) -> tuple[Candidate, _MilpRun | None]:
    """An interleaved finalist's split by the rank-level MILP (node-limited, with the chunk-by-chunk split as
    its incumbent, so never slower at the rank level), kept where it fits and its simulated step is lower;
    the candidate unchanged and None where the candidate is not interleaved or the MILP gives nothing."""
    pt = _point_of(c)
    if pt.v == 1 or c.boundaries is None or c.simulated_step_s is None:
        return c, None
    # imported here: the MILP needs scipy, which planning without an interleaved best never loads
    from stageplan.planning.interleaved import solve_interleaved

    prep = search.profiles[(pt.b, pt.t)]
    arr = search.arrays(pt.b, pt.t, pt.m, arrays)
    # torch's whole order: its live counts give each rank's exact activation peak, as plan() solves it
    opts = search.options(pt, prep.profile, full=True)
    inp = solver_inputs(arr, opts)
    exact = inp["activation_bytes"] is not None
    try:
        sol = solve_interleaved(
            inp["costs"], opts.num_ranks, opts.virtual_stages,
            rank_speeds=np.array([dev.speed for dev in opts.devices]),
            memory_bytes=inp["static_memory_bytes" if exact else "memory_bytes"],
            memory_limit_bytes=inp["limits"], placement=opts.shape.stage_ranks,
            boundary_costs=inp["boundary_costs"], memory_start_bytes=inp["memory_start_bytes"],
            memory_end_bytes=inp["memory_end_bytes"],
            activation_bytes=inp["activation_bytes"] if exact else None,
            live_counts=opts.shape.live_counts if exact else None,
            time_limit_s=MILP_TIME_LIMIT_S, node_limit=MILP_NODE_LIMIT, incumbent=c.boundaries)
    except StageplanError:  # no split within the budget (InfeasiblePlanError included): keep the chunk split
        return c, None
    run = _MilpRun(sol.bottleneck, sol.lower_bound, sol.nodes, False)
    if tuple(sol.boundaries) == tuple(c.boundaries):
        return c, run
    cand = price(search, pt, prep, arr, search.options(pt, prep.profile), sol.boundaries,
                 c.lower_bound_step_s or 0.0)
    if not cand.feasible:  # the layout's memory (zero1's whole tensors included) is over the limit
        return c, run
    # the MILP balances the ranks' loads, which the simulated step need not follow
    step = evaluate(arr, sol.boundaries, opts).predicted_step_s
    if step >= c.simulated_step_s:
        return c, run
    tps, mfu, hfu = _rates(search, prep, pt, step)
    return (replace(cand, simulated_step_s=step, tokens_per_s_per_device=tps, mfu=mfu, hfu=hfu),
            replace(run, kept=True))


def _point_of(c: Candidate) -> _Point:
    return _Point(c.tensor_parallel, c.pipeline_parallel, c.data_parallel, c.microbatch_size,
                  c.num_microbatches, c.schedule, c.virtual_stages, c.recompute, c.sharding, c.placement)


def search_layouts(
    profiles: Mapping[tuple[int, int], Profile], num_devices: int, *, global_batch_size: int,
    network: Network, memory_limit_bytes: float | None = None, precision: str = "bf16-mixed",
    grad_dtype: str = "param", optimizer: str = "adam",
    tensor_parallel: Sequence[int] = DEFAULT_TENSOR_PARALLEL,
    microbatch_sizes: Sequence[int] = DEFAULT_MICROBATCH_SIZES,
    schedules: Sequence[str] = DEFAULT_SCHEDULES, virtual_stages: Sequence[int] | None = None,
    recompute: Sequence[bool] = DEFAULT_RECOMPUTE, shardings: Sequence[str] = SHARDINGS,
    sequence_parallel: bool = False, top: int = 10, bounds: bool = True,
    pipeline_parallel: Sequence[int] | None = None,
) -> Layout:
    """Search the layout grid over ``num_devices`` devices given the profiles per (microbatch size, tensor
    degree), and rank the feasible candidates (module docstring). Refusals name the rule, the values and the
    remedy; a grid with no feasible candidate raises ``InfeasiblePlanError`` with the smallest memory limit
    that admits one (``min_memory_limit_bytes``) and the smallest device count that does at this limit."""
    _check(num_devices, global_batch_size, network, precision, grad_dtype, optimizer, tensor_parallel,
           microbatch_sizes, schedules, shardings, top, memory_limit_bytes)
    prepared = _prepared(profiles, network, tensor_parallel, microbatch_sizes, sequence_parallel)
    L = len(next(iter(prepared.values())).profile)
    search = _Search(prepared, num_devices, global_batch_size, network, memory_limit_bytes, precision,
                     grad_dtype, optimizer, sequence_parallel)
    rejected: dict[str, dict[str, Any]] = {}
    grid_args: _GridArgs = (tensor_parallel, pipeline_parallel, microbatch_sizes,
                            [normalize_schedule(s) for s in schedules], virtual_stages, recompute, shardings)
    points = _grid(search, L, *grid_args, rejected)
    if not points:
        rules = sorted({x for r in rejected.values() for x in r.get("rules", [])})
        raise StageplanError(
            f"no layout of {num_devices} devices fits the grid: p x dp x tp must be {num_devices} with p <= "
            f"{L} layers and the global batch {global_batch_size} a multiple of b x dp "
            f"({'; '.join(rules) or 'no profile for these degrees'}); change --devices, --global-batch-size "
            "or --microbatch-sizes")
    arrays: dict[tuple[int, int, int], LayerArrays] = {}
    bounded = []
    for pt in points:
        arr = search.arrays(pt.b, pt.t, pt.m, arrays)
        per = bytes_per_param(precision, optimizer, pt.sharding, pt.d, grad_dtype).total
        bounded.append((*lower_bounds(arr, pt, per, network.bandwidth(search.spans(pt)["pp"])), pt))
    if bounds and memory_limit_bytes is not None:
        # the split bound where the closed form leaves a candidate under the limit
        bounded = _tighten(search, bounded, arrays, lambda mem: mem <= memory_limit_bytes * (1 + MEMORY_RTOL))
    bounded.sort(key=lambda x: (x[0], _order_key(x[2])))
    priced: list[Candidate] = []
    over_limit: list[Candidate] = []
    counts = {"grid": len(points), "priced": 0, "pruned_by_time": 0, "pruned_by_memory": 0, "infeasible": 0}
    threshold = math.inf
    least_over: float | None = None
    for step_lb, mem_lb, pt in bounded:
        if bounds and memory_limit_bytes is not None and mem_lb > memory_limit_bytes * (1 + MEMORY_RTOL):
            counts["pruned_by_memory"] += 1
            _reject(rejected, _family(pt), "memory", over_bytes=mem_lb - memory_limit_bytes)
            least_over = mem_lb if least_over is None else min(least_over, mem_lb)
            continue
        if bounds and step_lb > threshold * (1 + 1e-9):
            counts["pruned_by_time"] += 1
            _reject(rejected, _family(pt), "time", step_bound_s=step_lb)
            continue
        if bounds and pt.v == 1 and pt.p > 1:
            # one chunk a rank: the slowest rank takes at least the least bottleneck of any split (memory only
            # narrows the splits), exactly as the solver finds it (less its 1e-12 tolerance)
            arr = search.arrays(pt.b, pt.t, pt.m, arrays)
            _, least = search.free_split(arr, pt, network.bandwidth(search.spans(pt)["pp"]))
            step_lb = max(step_lb, (pt.m + pt.p - 1) * least * (1 - 1e-9))
            if step_lb > threshold * (1 + 1e-9):
                counts["pruned_by_time"] += 1
                _reject(rejected, _family(pt), "time", step_bound_s=step_lb)
                continue
        counts["priced"] += 1
        cand = _price_point(search, pt, arrays, step_lb)
        if not cand.feasible:
            counts["infeasible"] += 1
            over = (cand.peak_memory_bytes or math.inf) - (memory_limit_bytes or 0.0)
            _reject(rejected, _family(pt), "memory", over_bytes=over)
            need = cand.peak_memory_bytes
            if need is not None:
                least_over = need if least_over is None else min(least_over, need)
            if need is not None and math.isfinite(need):
                over_limit.append(cand)
            continue
        priced.append(cand)
        # the ranking lists the first --top by step (the simulator ranks those within BAND of the best): a
        # candidate whose step bound is above the --top-th step found cannot be one of them
        threshold = heapq.nsmallest(top, (c.step_s for c in priced))[-1] if len(priced) >= top else math.inf
    if not priced:
        raise _none_fits(search, bounded, arrays, counts["grid"], L, grid_args)
    layout = _finish(search, priced, rejected, counts, top, arrays, L)
    return replace(layout, over_limit=tuple(over_limit))


def _none_fits(search: _Search, bounded: list[tuple[float, float, _Point]],
               arrays: dict[tuple[int, int, int], LayerArrays], grid: int, L: int, grid_args: _GridArgs
               ) -> InfeasiblePlanError:
    """Why no candidate fits, in one line: the smallest memory limit at which the search finds a layout
    (``_least_limit``), the smallest device count that admits one at this limit (``_least_devices``; none
    where one block's activations for one microbatch overflow a device, which only context parallelism, not
    modelled, would split), and the remedies."""
    limit = float(search.memory_limit_bytes or 0.0)
    floors = _tighten(search, bounded, arrays, lambda mem: True)
    least = _least_limit(search, floors, arrays)
    # every layout holds, on some device, the largest layer's activations for one microbatch of its (b, t)
    act = min(float(max(x.activation_bytes for x in prep.profile.layers))
              for prep in search.profiles.values())
    parts, remedies = [], []
    if least is not None:
        need, cand = least
        parts.append(f"the smallest memory limit that admits one is {format_bytes(need)} ({cand.degrees})")
        remedies.append(f"raise --memory-limit to {_bytes_up(need)}")
    if act > limit:
        parts.append(f"a layer's activations for one microbatch alone take {format_bytes(act)} in every "
                     "layout: the sequence does not fit without context parallelism, which stageplan does "
                     "not model, at any device count")
    else:
        most = max(8 * search.num_devices, search.network.devices_per_node)
        found = _least_devices(search, arrays, L, grid_args, most)
        if found is not None:
            n, cand = found
            parts.append(f"the smallest device count that admits one at {format_bytes(limit)} is {n} "
                         f"({cand.degrees})")
            remedies.append(f"use --devices {n}")
        else:
            parts.append(f"no device count up to {most} admits one at {format_bytes(limit)} (counted per "
                         f"device up to a node, then in whole nodes of {search.network.devices_per_node})")
    shardings, recompute = grid_args[6], grid_args[5]
    missing = ([] if "fsdp" in shardings else ["--sharding fsdp"]) + ([] if True in recompute
                                                                      else ["--recompute full"])
    if missing:
        remedies.append(f"allow {' and '.join(missing)}")
    return InfeasiblePlanError(
        f"no layout of {search.num_devices} devices fits {format_bytes(limit)} per device ({grid} "
        f"candidates): {'; '.join(parts)}; {', or '.join(remedies) or 'shorten the sequence'}",
        min_memory_limit_bytes=None if least is None else least[0])


def _bytes_up(n: float) -> str:
    """``n`` bytes as a --memory-limit value, rounded up to the hundredth of its unit (so that it admits what
    ``n`` admits)."""
    # format_bytes' units
    for unit, scale in (("TiB", 2.0**40), ("GiB", 2.0**30), ("MiB", 2.0**20), ("KiB", 2.0**10)):
        if n >= scale:
            return f"{math.ceil(n / scale * 100) / 100:.2f}{unit}"
    return f"{math.ceil(n)}B"


def _price_at(search: _Search, pt: _Point, arrays: dict[tuple[int, int, int], LayerArrays], limit: float
              ) -> Candidate:
    """The candidate priced as a search with memory limit ``limit`` prices it."""
    return _price_point(replace(search, memory_limit_bytes=limit), pt, arrays, 0.0)


def _least_limit(search: _Search, floors: list[tuple[float, float, _Point]],
                 arrays: dict[tuple[int, int, int], LayerArrays]) -> tuple[float, Candidate] | None:
    """The smallest memory limit at which the search prices some candidate feasible, and that candidate:
    candidates in the order of their memory floors (``floors``, valid lower bounds), each one's least limit
    (``_least_limit_of``), until the next floor is above the least found."""
    best: tuple[float, Candidate] | None = None
    for _, floor, pt in sorted(floors, key=lambda x: (x[1], _order_key(x[2]))):
        if best is not None and floor >= best[0]:
            break
        found = _least_limit_of(search, pt, floor, arrays, math.inf if best is None else best[0])
        if found is not None:
            best = found
    return best


def _least_limit_of(search: _Search, pt: _Point, floor: float,
                    arrays: dict[tuple[int, int, int], LayerArrays], below: float
                    ) -> tuple[float, Candidate] | None:
    """The smallest limit under ``below`` at which this candidate is priced feasible, with the candidate
    priced there; None where there is none. The limit is at least its floor and the least fullest chunk of
    any split (the solver's exact figure: a rank holds at least its chunks); where the candidate fits there,
    that is the answer. Else the fullest rank of its split without memory rows is a limit it fits (that split
    is then kept), and bisection between the two (to 1e-6, each step pricing it as the search would) finds
    the smallest."""
    prep = search.profiles[(pt.b, pt.t)]
    arr = search.arrays(pt.b, pt.t, pt.m, arrays)
    opts = search.options(pt, prep.profile)
    inp = solver_inputs(arr, opts)
    try:
        solve(inp["costs"], opts.num_chunks, memory_bytes=inp["memory_bytes"],
              memory_start_bytes=inp["memory_start_bytes"], memory_end_bytes=inp["memory_end_bytes"],
              memory_limit_bytes=1.0)
        chunks = 0.0
    except InfeasiblePlanError as exc:
        chunks = float(exc.min_memory_limit_bytes or 0.0)
    lo = max(floor, chunks)
    if lo >= below:
        return None
    cand = _price_at(search, pt, arrays, lo)
    if cand.feasible:
        return lo, cand
    free, _ = search.free_split(arr, pt, opts.bandwidth_bytes_per_s)
    hi = max(_rank_memory(search, prep.profile, arr, free, opts)[0])
    cand = _price_at(search, pt, arrays, hi)
    if not cand.feasible:  # the split without memory rows fits its own peak: not reached
        return None
    while hi - lo > 1e-6 * hi and lo < below:
        mid = (lo + hi) / 2
        at = _price_at(search, pt, arrays, mid)
        if at.feasible:
            hi, cand = mid, at
        else:
            lo = mid
    return (hi, cand) if hi < below else None


def _least_devices(search: _Search, arrays: dict[tuple[int, int, int], LayerArrays], L: int,
                   grid_args: _GridArgs, most: int) -> tuple[int, Candidate] | None:
    """The smallest device count above this one, up to ``most``, for which the grid holds a candidate the
    search prices feasible at this limit, and that candidate: every count up to a node, then whole nodes.
    Per count, candidates under the memory floors (closed form and split bound) are priced in the order of
    their floors until one fits."""
    limit = float(search.memory_limit_bytes or 0.0)
    node = search.network.devices_per_node
    n = search.num_devices
    while True:
        n = n + 1 if n < node else (n // node + 1) * node
        if n > most:
            return None
        other = replace(search, num_devices=n)
        points = _grid(other, L, *grid_args, {})
        bounded = []
        for pt in points:
            arr = other.arrays(pt.b, pt.t, pt.m, arrays)
            per = bytes_per_param(search.precision, search.optimizer, pt.sharding, pt.d, search.grad_dtype)
            bounded.append((0.0, lower_bounds(arr, pt, per.total)[1], pt))
        floors = _tighten(other, bounded, arrays, lambda mem: mem <= limit * (1 + MEMORY_RTOL))
        for _, floor, pt in sorted(floors, key=lambda x: (x[1], _order_key(x[2]))):
            if floor > limit * (1 + MEMORY_RTOL):
                break
            cand = _price_point(other, pt, arrays, 0.0)
            if cand.feasible:
                return n, cand


def _order_key(pt: _Point) -> tuple[Any, ...]:
    """Deterministic tie order between candidates of equal step: fewer pipeline stages, less tensor
    parallelism, larger microbatches, no recompute, the simpler schedule and sharding first."""
    return (pt.p, pt.t, -pt.b, pt.recompute, LAYOUT_SCHEDULES.index(pt.schedule), pt.v,
            SHARDINGS.index(pt.sharding))


def _family(pt: _Point) -> str:
    return f"tp{pt.t} pp{pt.p} dp{pt.d}"


def _price_point(search: _Search, pt: _Point, arrays: dict[tuple[int, int, int], LayerArrays],
                 step_lb: float) -> Candidate:
    prep = search.profiles[(pt.b, pt.t)]
    arr = search.arrays(pt.b, pt.t, pt.m, arrays)
    opts = search.options(pt, prep.profile)
    limit = search.memory_limit_bytes

    def fits(boundaries: tuple[int, ...], rows: np.ndarray, start: np.ndarray | None, end: np.ndarray | None
             ) -> bool:
        if limit is None:
            return True
        # each chunk at its own peak, summed per rank: an upper bound on the rank's peak (exact for one chunk
        # a rank); only where it is over does the exact count over torch's order run
        upper = np.zeros(opts.num_ranks)
        for s in range(len(boundaries) - 1):
            i, j = boundaries[s], boundaries[s + 1]
            upper[opts.shape.stage_ranks[s]] += (rows[s, i:j].sum()
                                                 + (start[s, i] if start is not None else 0)
                                                 + (end[j - 1] if end is not None else 0))
        extra, _ = _zero1_extra(prep.profile, boundaries, opts)
        if (upper + np.asarray(extra)).max() <= limit:
            return True
        return max(_rank_memory(search, prep.profile, arr, boundaries, opts)[0]) <= limit

    try:
        boundaries = _split(search, arr, pt, opts, fits)
    except InfeasiblePlanError as exc:
        need = getattr(exc, "min_memory_limit_bytes", None)
        return _candidate(search, pt, prep, None, math.inf, step_lb,
                          [need if need is not None else math.inf], {}, {})
    return price(search, pt, prep, arr, opts, boundaries, step_lb)


def _finish(
    search: _Search,
    priced: list[Candidate],
    rejected: dict[str, dict[str, Any]],
    counts: dict[str, int],
    top: int,
    arrays: dict[tuple[int, int, int], LayerArrays],
    L: int,
) -> Layout:
    """Simulate the best ``top`` over torch's order, rank them by the simulated step, and make the best's
    Plan (the exact split with its tie-break, as ``plan`` makes it)."""
    priced.sort(key=lambda c: (c.step_s, _order_key(_point_of(c))))
    lead = priced[0].step_s
    band = [c for c in priced if c.step_s <= lead * (1 + BAND) * (1 + 1e-9)][:top]
    finalists = []
    for c in band:
        pt = _point_of(c)
        prep = search.profiles[(pt.b, pt.t)]
        arr = search.arrays(pt.b, pt.t, pt.m, arrays)
        opts = search.options(pt, prep.profile, full=True)
        assert c.boundaries is not None
        ev = evaluate(arr, c.boundaries, opts)
        tps, mfu, hfu = _rates(search, prep, pt, ev.predicted_step_s)
        finalists.append(replace(c, simulated_step_s=ev.predicted_step_s, tokens_per_s_per_device=tps,
                                 mfu=mfu, hfu=hfu))
    finalists.sort(key=lambda c: (c.step_s, _order_key(_point_of(c))))
    best = finalists[0]
    notes = []
    other = _other_placement(search, best, arrays)
    if other is not None:
        notes.append(f"placing the pipeline inside the data-parallel groups ({other.placement}, innermost "
                     f"first) is {best.step_s / other.step_s - 1:.1%} faster for this layout: its groups "
                     f"across nodes are {', '.join(other.spans_nodes) or 'none'} instead of "
                     f"{', '.join(best.spans_nodes) or 'none'}")
        finalists.insert(0, other)  # the same degrees in torchtitan's order stay listed, second
        best = other
    # the best's split by the rank-level MILP where it simulates faster (it only lowers the best's step, so
    # the ranking stands); the best alone: the MILP's root takes about 2 s on LLaMA-3-70B's 28-chunk best at
    # 512 devices, and each of its 10 interleaved finalists' would break the search's 10 s goal
    best, run = _milp_split(search, best, arrays)
    pt = _point_of(best)
    prep = search.profiles[(pt.b, pt.t)]
    arr = search.arrays(pt.b, pt.t, pt.m, arrays)
    opts = search.options(pt, prep.profile, full=True)
    meta = {"microbatch_size": pt.b, "tensor_parallel": pt.t}
    plan = make_plan(prep.profile, arr, opts, "optimal", meta) if pt.v == 1 else None
    if plan is None or plan.predicted_step_s > best.step_s * (1 + 1e-12):
        # interleaved: the MILP balances the ranks' loads, which the simulated step need not follow; keep the
        # split the search simulated where it is faster
        plan = make_plan(prep.profile, arr, opts, "layout", meta, given=best.boundaries)
    if pt.t > 1:
        # what a run counts of its tensor-parallel all-reduces, per pipeline rank: its blocks' share
        blocks = _block_mask(prep.profile)
        per_rank = [[0, 0] for _ in range(pt.p)]
        for st in plan.stages:
            pair = tensor_parallel_collectives(int(blocks[st.first_layer:st.end_layer].sum()), pt.m, pt.t,
                                               pt.recompute, bool(blocks[st.end_layer - 1]))
            per_rank[st.rank] = [a + b for a, b in zip(per_rank[st.rank], pair)]
        meta_tp: dict[str, Any] = {"sequence_parallel": bool(search.sequence_parallel),
                                   "tensor_parallel_collectives": per_rank}
        plan = replace(plan, profile_meta={**plan.profile_meta, **meta_tp})
    memory, by_kind = _rank_memory(search, prep.profile, arr, plan.boundaries, opts)
    tps, mfu, hfu = _rates(search, prep, pt, plan.predicted_step_s)
    best = replace(best, boundaries=plan.boundaries, simulated_step_s=plan.predicted_step_s,
                   tokens_per_s_per_device=tps, mfu=mfu, hfu=hfu,
                   peak_memory_bytes=max(memory), memory_bytes=by_kind[int(np.argmax(memory))],
                   rank_memory_bytes=tuple(memory))
    finalists[0] = best
    ranked = tuple(finalists) + tuple(priced[len(band):])
    if best.scaled_from_microbatch_size is not None:
        notes.append(f"the best candidate's profile is scaled from microbatch size "
                     f"{best.scaled_from_microbatch_size} to {best.microbatch_size}: profile at that size to "
                     "confirm")
    if run is not None and run.kept:
        notes.append(f"interleaved split by the rank-level MILP: within {run.gap:.1%} of its proven optimum "
                     f"({run.nodes_text})")
    elif run is not None:
        notes.append(f"interleaved split chunk by chunk (the exact solver over {opts.num_chunks} chunks), "
                     "simulated no slower than the rank-level MILP's split, whose slowest rank is within "
                     f"{run.gap:.1%} of its proven optimum ({run.nodes_text})")
    elif pt.v > 1 and plan.lower_bound_s > 0:
        notes.append(f"interleaved split chunk by chunk (the exact solver over {opts.num_chunks} chunks, not "
                     f"the rank-level MILP): its slowest rank is within "
                     f"{plan.bottleneck_s / plan.lower_bound_s - 1:.1%}"
                     " of the proven lower bound max(total / p, largest layer)")
    _, zero1_note = _zero1_extra(prep.profile, plan.boundaries, opts)
    if zero1_note:
        notes.append(zero1_note)
    options = {"precision": search.precision, "grad_dtype": search.grad_dtype, "optimizer": search.optimizer,
               "devices_per_node": search.network.devices_per_node,
               "intra_node_bytes_per_s": search.network.intra_node_bytes_per_s,
               "inter_node_bytes_per_s": search.network.inter_node_bytes_per_s,
               "latency_s": search.network.latency_s, "layers": L,
               **({"dp_bandwidth_bytes_per_s": search.network.dp_bandwidth_bytes_per_s,
                   "dp_latency_s": search.network.dp_latency_s}
                  if search.network.dp_bandwidth_bytes_per_s is not None else {})}
    return Layout(search.num_devices, search.network.devices_per_node, search.global_batch_size,
                  search.memory_limit_bytes, ranked,
                  tuple(sorted(rejected.values(), key=lambda r: r["family"])),
                  counts, options, plan, None, tuple(notes))


def _other_placement(search: _Search, best: Candidate, arrays: dict[tuple[int, int, int], LayerArrays]
                     ) -> Candidate | None:
    """The best layout with its pipeline inside its data-parallel groups (tensor, pipeline, data, innermost
    first), priced and simulated the same way, where that moves a group across nodes and is faster; else
    None. Only the best is tried: the order changes which link a group uses, not its split's memory."""
    pt = _point_of(best)
    alt = replace(pt, placement="tp,pp,dp")
    if pt.d == 1 or pt.p == 1 or search.spans(alt) == search.spans(pt):
        return None
    cand = _price_point(search, alt, arrays, best.lower_bound_step_s or 0.0)
    if not cand.feasible or cand.boundaries is None:
        return None
    prep = search.profiles[(alt.b, alt.t)]
    arr = search.arrays(alt.b, alt.t, alt.m, arrays)
    step = evaluate(arr, cand.boundaries, search.options(alt, prep.profile, full=True)).predicted_step_s
    if step >= best.step_s * (1 - 1e-9):
        return None
    tps, mfu, hfu = _rates(search, prep, alt, step)
    return replace(cand, simulated_step_s=step, tokens_per_s_per_device=tps, mfu=mfu, hfu=hfu)


def _prepared(profiles: Mapping[tuple[int, int], Profile], network: Network, tensor_parallel: Sequence[int],
              microbatch_sizes: Sequence[int], sequence_parallel: bool) -> dict[tuple[int, int], _Prepared]:
    """Each (b, t) of the grid with a profile: its own, or
    the nearest measured b at that t scaled linearly."""
    out: dict[tuple[int, int], _Prepared] = {}
    lengths = {len(p) for p in profiles.values()}
    if len(lengths) > 1:
        raise StageplanError(f"the profiles have different layer counts ({sorted(lengths)}); give profiles "
                             "of one model, one per microbatch size and tensor degree")
    for t in tensor_parallel:
        have = sorted(b for (b, tt) in profiles if tt == t)
        if not have:
            continue
        for b in microbatch_sizes:
            if (b, t) in profiles:
                prof, scaled = profiles[(b, t)], None
            else:
                src = max([x for x in have if x <= b], default=have[0])
                prof, scaled = scale_profile(profiles[(src, t)], b), src
            out[(b, t)] = prepare_profile(prof, t, network, sequence_parallel=sequence_parallel,
                                          scaled_from=scaled)
    if not out:
        raise StageplanError(f"no profile for tensor-parallel degrees {list(tensor_parallel)}; give a "
                             "profile per degree, or --tensor-parallel 1 for a profile of the whole model")
    return out


def _check(
    num_devices: object,
    global_batch_size: object,
    network: Network,
    precision: str,
    grad_dtype: str,
    optimizer: str,
    tensor_parallel: Sequence[int],
    microbatch_sizes: Sequence[int],
    schedules: Sequence[str],
    shardings: Sequence[str],
    top: object,
    memory_limit: float | None,
) -> None:
    for name, value in (("the device count", num_devices), ("the global batch size", global_batch_size),
                        ("devices per node", network.devices_per_node), ("--top", top)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise StageplanError(f"{name} must be an integer >= 1, got {value!r}")
    for what, values in (("tensor-parallel degree", tensor_parallel), ("microbatch size", microbatch_sizes)):
        bad = [v for v in values if isinstance(v, bool) or not isinstance(v, int) or v < 1]
        if bad or not values:
            raise StageplanError(f"each {what} must be an integer >= 1, got {list(values)!r}")
    over = [t for t in tensor_parallel if t > network.devices_per_node]
    if over:
        raise StageplanError(
            f"tensor parallelism stays within a node: t = {over[0]} exceeds the "
            f"{network.devices_per_node} devices per node; use --tensor-parallel "
            f"{','.join(str(t) for t in tensor_parallel if t <= network.devices_per_node) or 1}"
        )
    if not any(num_devices % t == 0 for t in tensor_parallel):  # type: ignore[operator]
        raise StageplanError(f"{num_devices} devices is not a multiple of any tensor-parallel degree "
                             f"{list(tensor_parallel)}; use a device count they divide")
    if precision not in PRECISIONS:
        raise StageplanError(f"unknown precision {precision!r}; use one of {', '.join(PRECISIONS)}")
    if optimizer not in OPTIMIZER_STATES:
        raise StageplanError(f"unknown optimizer {optimizer!r}; use one of {', '.join(OPTIMIZER_STATES)}")
    for sh in shardings:
        check_sharding(sh, grad_dtype)
    for s in schedules:
        if normalize_schedule(s) not in LAYOUT_SCHEDULES:
            raise StageplanError(f"the layout search prices {', '.join(LAYOUT_SCHEDULES)}, got {s!r}; plan a "
                                 "zero-bubble schedule for one layout with stageplan plan --schedule")
    for bw in (network.intra_node_bytes_per_s, network.inter_node_bytes_per_s):
        if not (math.isfinite(bw) and bw > 0):
            raise StageplanError(f"bandwidths must be positive bytes/s, got {bw!r}; e.g. "
                                 "--inter-node-bandwidth 50GB/s")
    if memory_limit is not None and not (math.isfinite(memory_limit) and memory_limit > 0):
        raise StageplanError(f"memory limit must be a positive number of bytes, got {memory_limit!r}; e.g. "
                             "--memory-limit 80GiB")


def score_given(
    profiles: Mapping[tuple[int, int], Profile], num_devices: int, *, global_batch_size: int,
    network: Network,
    memory_limit_bytes: float | None, precision: str, grad_dtype: str, optimizer: str, t: int, p: int, d: int,
    b: int, schedule: str, v: int, recompute: bool, sharding: str, sequence_parallel: bool = False,
    boundaries: Sequence[int] | None = None,
) -> Candidate:
    """Price one layout the user already runs, as the search prices its candidates (its own split where
    ``boundaries`` gives one, else the exact split), and simulate it."""
    check_sharding(sharding, grad_dtype)
    if not any(tt == t for (_, tt) in profiles):  # another b at this t is scaled, as the search scales it
        raise StageplanError(f"no profile at tensor-parallel degree {t} for the given layout; profile the "
                             "t-way shard (stageplan layout MODEL --device estimate:GPU makes them)")
    prepared = _prepared(profiles, network, [t], [b], sequence_parallel)
    search = _Search(prepared, num_devices, global_batch_size, network, memory_limit_bytes, precision,
                     grad_dtype, optimizer, sequence_parallel)
    m = global_batch_size // (b * d)
    name = normalize_schedule(schedule)
    check_microbatches(name, p, m, v)
    pt = _Point(t, p, d, b, m, name, v, recompute, sharding)
    prep = prepared[(b, t)]
    arr = LayerArrays.of(prep.profile, m)
    opts = search.options(pt, prep.profile, full=True)
    per = bytes_per_param(precision, optimizer, sharding, d, grad_dtype).total
    step_lb = lower_bounds(arr, pt, per, opts.bandwidth_bytes_per_s)[0]
    if boundaries is None:
        cand = _price_point(search, pt, {(b, t, m): arr}, step_lb)
        if cand.boundaries is None:
            return cand
        boundaries = cand.boundaries
    bounds = tuple(int(x) for x in boundaries)
    L = len(arr.forward_s)
    if len(bounds) != opts.num_chunks + 1 or bounds[0] != 0 or bounds[-1] != L or any(
            x >= y for x, y in zip(bounds, bounds[1:])):
        raise StageplanError(f"the given split has {len(bounds) - 1} stages for pp {p} x vp {v} = "
                             f"{opts.num_chunks} chunks over {L} layers; give a layout with "
                             f"{opts.num_chunks} "
                             "stages")
    cand = price(search, pt, prep, arr, opts, bounds, step_lb)
    ev = evaluate(arr, bounds, opts)
    tps, mfu, hfu = _rates(search, prep, pt, ev.predicted_step_s)
    return replace(cand, simulated_step_s=ev.predicted_step_s, tokens_per_s_per_device=tps, mfu=mfu, hfu=hfu)


__all__ = [
    "Network",
    "lower_bounds",
    "model_flops_per_token",
    "prepare_profile",
    "scale_profile",
    "score_given",
    "search_layouts",
]
