"""Plain-text tables for profiles, plans and runs (no torch)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from stageplan.formats.layout import Layout
from stageplan.formats.plan import Plan
from stageplan.formats.profile import Profile
from stageplan.formats.runreport import RunReport
from stageplan.formats.schedule import RESUME_GAP_S
from stageplan.host import run_contention, slower_explained
from stageplan.units import format_bytes

MiB = 1024.0**2


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], *,
                 right: Sequence[bool] | None = None) -> str:
    """Aligned plain-text table; numbers right-aligned."""
    cells = [[str(h) for h in headers]] + [["" if v is None else str(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    if right is None:
        right = [i > 0 for i in range(len(headers))]
    lines = []
    for n, row in enumerate(cells):
        parts = [c.rjust(w) if right[i] else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(parts).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def ms(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds * 1e3:.3f}"


def mib(nbytes: float | None) -> str:
    return "" if nbytes is None else f"{nbytes / MiB:.2f}"


def ratio(x: float | None) -> str:
    return "" if x is None else f"{x:.3f}"


def figure(x: float | None, spec: str = ".3g") -> str:
    """A number as ``spec``, or '-' where a report holds null
    (a NaN or infinity written to JSON, a field not read)."""
    return "-" if x is None else format(x, spec)


def profile_table(profile: Profile) -> str:
    """Per-layer table in ms and MiB, with totals, where each row's figures came from, and the sum-vs-whole
    ratio (or why the whole model was not timed)."""
    headers = ["#", "layer", "fwd ms", "bwd ms", "spread %", "act MiB", "out MiB", "param MiB", "measured as"]
    rows = []
    for i, layer in enumerate(profile.layers):
        total = layer.forward_s + layer.backward_s
        spread = 100.0 * (layer.forward_iqr_s + layer.backward_iqr_s) / total if total > 0 else 0.0
        rows.append([i, layer.name, ms(layer.forward_s), ms(layer.backward_s), f"{spread:.1f}",
                     mib(layer.activation_bytes), mib(layer.output_bytes), mib(layer.param_bytes),
                     f"= {layer.measured_as}" if layer.measured_as else ""])
    f = sum(layer.forward_s for layer in profile.layers)
    b = sum(layer.backward_s for layer in profile.layers)
    rows.append(["", "total", ms(f), ms(b), "", mib(sum(x.activation_bytes for x in profile.layers)), "",
                 mib(sum(x.param_bytes for x in profile.layers)), ""])
    table = format_table(headers, rows, right=[True, False, True, True, True, True, True, True, False])
    meta = profile.meta
    lines = [table]
    whole = meta.get("whole_model_s")
    if whole:
        lines.append(f"whole model fwd+bwd {ms(whole)} ms; sum of layers / whole = "
                     f"{ratio(profile.sum_vs_whole)} "
                     "(near 1: timing layers alone misses little of the whole model's time)")
    elif meta.get("whole_model"):
        lines.append(f"whole model not timed ({meta['whole_model']}): no sum-of-layers / whole ratio")
    estimate = meta.get("estimate")
    if meta.get("timer") == "analytic" and isinstance(estimate, dict):
        lines.append(f"times are analytic estimates for {estimate.get('gpu')} (compute efficiency "
                     f"{estimate.get('eta_c')}, memory efficiency {estimate.get('eta_m')}, "
                     f"{estimate.get('attention', 'flash')} attention): {estimate.get('accuracy')}; "
                     f"activation and output bytes are exact")
    else:
        lines.append("spread % = (fwd IQR + bwd IQR) / (fwd + bwd) over the timed rounds: how much a layer's "
                     "time varied; act = bytes saved for backward per microbatch, out = bytes crossing to "
                     "the next layer")
    reused = sum(1 for x in profile.layers if x.measured_as)
    if reused:
        line = (f"measured as = the identical layer whose times and act bytes a row reuses "
                f"({len(profile.layers) - reused} distinct of {len(profile.layers)} layers)")
        spread_check = meta.get("dedup_spread")
        if isinstance(spread_check, dict) and spread_check.get("forward_ratio") is not None:
            line += (f"; {spread_check['layer']} / {spread_check['vs']}: fwd "
                     f"{ratio(spread_check['forward_ratio'])}, bwd "
                     f"{ratio(spread_check.get('backward_ratio'))}")
        lines.append(line)
    pooled = meta.get("pooled_layers")
    if isinstance(pooled, list) and pooled and all(isinstance(g, list) for g in pooled):
        lines.append("pooled: " + "; ".join(", ".join(map(str, g)) for g in pooled) + " (identical layers "
                     "between identical neighbours, timed in a stage's order: each group's times are the "
                     "medians over all its members' rounds)")
    procs = meta.get("processes")
    if isinstance(procs, dict) and isinstance(procs.get("range"), list) and procs["range"]:
        widest = max(procs["range"], key=lambda r: max(r.get("forward", 0.0), r.get("backward", 0.0)))
        lines.append(f"times are the median over {procs.get('count')} processes; the widest range between "
                     f"them: {widest.get('layer')} fwd {widest.get('forward', 0.0):.1%}, bwd "
                     f"{widest.get('backward', 0.0):.1%}")
    desc = ", ".join(f"{k}={meta[k]}" for k in ("model", "device", "dtype", "microbatch_size", "threads",
                                                "repeats",
                                                 "materialized", "order") if meta.get(k) is not None)
    if desc:
        lines.append(desc)
    return "\n".join(lines)


# A note printed without --explain fits one terminal line: "note: " and at most this many characters
NOTE_WIDTH = 100


def note_line(note: str, width: int = NOTE_WIDTH) -> str:
    """A note's one-line form: its first clause (up to the first "; "), cut at a word within ``width``
    characters, with " ..." where anything was left out (--explain, or the plan's JSON, has the whole note).

    >>> note_line("no bandwidth given: comm is not modelled; give --bandwidth or --link")
    'no bandwidth given: comm is not modelled ...'
    >>> note_line("short")
    'short'
    """
    head = note.split("; ", 1)[0]
    if len(head) > width:
        head = head[:width].rsplit(" ", 1)[0].rstrip(",:;(")
    return head if head == note else f"{head} ..."


def plan_table(plan: Plan, *, explain: bool = False) -> str:
    """Per-stage table (layers, ms, MiB, % of the bottleneck) and the plan's headline figures. fwd, bwd, comm
    and time are per microbatch; "optimizer ms" is the stage's optimizer step, once per step; "tied sync ms"
    (shown when the plan puts a tied parameter on two or more ranks) is the rank's tied-gradient all-reduce,
    once per step before the optimizer step, on the rank's first stage; "chunk ms" (shown when the link timed
    it) is what PipelineStage spends inside the stage's forward and backward outside its layers, part of fwd
    and bwd; "loop ms" (likewise) is what torch's schedule spends around the stage's forward and backward,
    outside them. A note is one line (:func:`note_line`) unless ``explain``."""
    tied = plan.tied_sync_s > 0
    loop = any(st.action_s > 0 for st in plan.stages)
    chunk = any(st.chunk_s > 0 for st in plan.stages)
    headers = ["stage", "rank", "layers", "n", "fwd ms", "bwd ms", *(["chunk ms"] if chunk else []),
               "comm ms", *(["loop ms"] if loop else []),
               "time ms", "% of bottleneck",
               *(["tied sync ms"] if tied else []), "optimizer ms", "in flight", "mem MiB", "limit MiB"]
    rows = []
    for st in plan.stages:
        span = st.layers[0] if len(st.layers) == 1 else f"{st.layers[0]} .. {st.layers[-1]}"
        rows.append([st.index, st.rank, span, len(st.layers), ms(st.forward_s), ms(st.backward_s),
                     *([ms(st.chunk_s)] if chunk else []), ms(st.comm_s),
                     *([ms(st.action_s)] if loop else []), ms(st.time_s),
                     f"{100 * st.time_s / plan.bottleneck_s:.1f}" if plan.bottleneck_s else "",
                     *([ms(st.tied_sync_s)] if tied else []), ms(st.optimizer_s), st.inflight,
                     mib(st.memory["total"]), mib(st.memory_limit_bytes)])
    right = [True, True, False] + [True] * (len(headers) - 3)
    lines = [format_table(headers, rows, right=right)]
    kinds = [k for k in plan.stages[0].memory if k != "total"]
    mem_rows = [[st.index, *(mib(st.memory.get(k, 0.0)) for k in kinds), mib(st.memory["total"])]
                for st in plan.stages]
    precision = plan.cost_options.get("precision")
    lines.append(f"memory by kind, MiB ({'precision ' + precision if precision else 'as profiled'}, "
                 f"optimizer {plan.cost_options.get('optimizer')}):")
    lines.append(format_table(["stage", *kinds, "total"], mem_rows, right=[True] * (len(kinds) + 2)))
    if plan.virtual_stages > 1:
        lines.append("rank time ms: " + ", ".join(f"{t * 1e3:.3f}" for t in plan.rank_time_s))
    lines.append(
        f"{plan.method} plan{' (objective step)' if plan.cost_options.get('objective') == 'step' else ''}, "
        f"{plan.schedule}, {plan.num_ranks} ranks x {plan.virtual_stages} virtual"
        + (f" x {plan.data_parallel} replicas ({plan.cost_options.get('sharding', 'ddp')})"
           if plan.data_parallel > 1 else "")
        + f", {plan.num_microbatches} microbatches of {plan.cost_options.get('microbatch_size')}"
    )
    lines.append(
        f"bottleneck {ms(plan.bottleneck_s)} ms, lower bound {ms(plan.lower_bound_s)} ms, balance efficiency "
        f"{plan.balance_efficiency:.3f}, predicted step {ms(plan.predicted_step_s)} ms, bubble "
        f"{100 * plan.bubble_fraction:.1f}%, "
        + ("no throughput (a step predicted at 0 s)" if plan.throughput_samples_s is None else
           f"{plan.throughput_samples_s:.1f} samples/s")
        + (f", {plan.throughput_samples_s * tokens:,.0f} tokens/s ({tokens} a sample)"
           if (tokens := tokens_per_sample(plan.profile_meta)) and plan.throughput_samples_s else "")
    )
    lines.extend(_summary_extras(plan))
    lines.append(f"boundaries {list(plan.boundaries)}")
    if tied:
        lines.append(f"tied-gradient all-reduce {ms(plan.tied_sync_s)} ms per step on every rank, before its "
                     "optimizer step (a tied parameter is on two or more ranks)")
    if plan.versus_optimal:
        lines.extend(_versus_optimal_lines(plan))
    lines.extend(f"note: {n if explain else note_line(n)}" for n in plan.notes)
    if not explain and any(note_line(n) != n for n in plan.notes):
        lines.append("(notes cut to one line: --explain prints them whole)")
    if plan.candidates:
        lines.append("candidates:")
        crow = [[c["schedule"], c["num_microbatches"], c.get("microbatch_size", ""),
                 "yes" if c["feasible"] else "no", ms(c.get("predicted_step_s"))] for c in plan.candidates]
        lines.append(format_table(["schedule", "m", "mb size", "feasible", "step ms"], crow,
                                  right=[False, True, True, False, True]))
    return "\n".join(lines)


def size(nbytes: float) -> str:
    """Bytes in GiB when a GiB or more (a 70B rank's 77.5 GiB), else MiB."""
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / MiB:.1f} MiB"


def tokens_per_sample(meta: dict[str, Any]) -> int | None:
    """Tokens in one sample of a language model: its factory's seq_len, else the length of a [batch, tokens]
    input of a model with named blocks; None for other models (a convnet's image is no tokens)."""
    seq = (meta.get("factory_options") or {}).get("seq_len")
    if isinstance(seq, int) and not isinstance(seq, bool) and seq > 0:
        return seq
    shapes = meta.get("input_shapes")
    if meta.get("named_layers") and isinstance(shapes, list) and shapes and isinstance(shapes[0], list) \
            and len(shapes[0]) == 2 and isinstance(shapes[0][1], int):
        return int(shapes[0][1])
    return None


# Peak keys of gpus.json by the profiled dtype
_PEAK_KEY = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def model_flops_line(plan: Plan) -> str | None:
    """For an estimate of a language model: TFLOP/s per GPU and MFU, with the model FLOPs per token that
    ``stageplan layout`` counts (:func:`stageplan.planning.layouts.model_flops_per_token`: PaLM's 6N + 12 x
    layers x hidden x seq, Chowdhery et al. 2022 appendix B), so a plan and a layout of the same model give
    the same MFU; under recompute also HFU (the forward run again). A model whose shape is not known (no
    preset) counts 6N (Kaplan et al. 2020, "Scaling Laws for Neural Language Models")."""
    import json
    from importlib import resources

    from stageplan.planning.layouts import layout_model_of, model_flops_per_token

    meta = plan.profile_meta
    gpu = (meta.get("estimate") or {}).get("gpu") if meta.get("timer") == "analytic" else None
    tokens, params = tokens_per_sample(meta), meta.get("param_count")
    if not gpu or not tokens or not params or not plan.throughput_samples_s:
        return None
    table = json.loads(resources.files("stageplan").joinpath("gpus.json").read_text(encoding="utf-8"))
    key = _PEAK_KEY.get(str(meta.get("dtype")), "fp32")
    peak = float(table["gpus"].get(gpu, {}).get("peak_flops", {}).get(key, 0.0))
    model = layout_model_of(meta, float(params))
    recompute = bool(plan.cost_options.get("recompute"))
    if model is not None:
        flops, hardware = model_flops_per_token(model), model_flops_per_token(model, recompute=True)
        how = (f"6 x {params / 1e9:.1f}e9 parameters + 12 x {model['num_layers']} layers x "
               f"{model['hidden_size']} hidden x {model['seq_len']} tokens FLOPs a token")
    else:
        flops, hardware = 6.0 * params, 8.0 * params
        how = f"6 x {params / 1e9:.1f}e9 parameters FLOPs a token"
    per_gpu = plan.throughput_samples_s * tokens * flops / (plan.num_ranks * plan.data_parallel)
    mfu = f", MFU {per_gpu / peak:.1%} of the {key} peak {peak / 1e12:.1f} TFLOP/s" if peak else ""
    if peak and recompute:
        mfu += f", HFU {per_gpu * hardware / flops / peak:.1%} (the recomputed forward counted)"
    return f"estimate: {per_gpu / 1e12:.0f} TFLOP/s per GPU{mfu} ({how})"


def _summary_extras(plan: Plan) -> list[str]:
    """The lines an LLM trainer looks for beside the bottleneck: the fullest rank against the limit, and for
    an estimate its TFLOP/s per GPU and MFU."""
    fullest = max(range(plan.num_ranks), key=lambda r: plan.rank_memory_bytes[r])
    need = plan.rank_memory_bytes[fullest]
    limits = [st.memory_limit_bytes for st in plan.stages if st.rank == fullest and st.memory_limit_bytes]
    if limits:
        verdict = "fits" if need <= min(limits) else "does NOT fit"
        lines = [f"memory: {verdict} {size(min(limits))}: fullest rank {size(need)} (rank {fullest})"]
    else:
        lines = [f"memory: fullest rank {size(need)} (rank {fullest}; no limit given)"]
    flops = model_flops_line(plan)
    return lines + ([flops] if flops else [])


GIVEN_AS = {"boundaries": "--boundaries", "megatron_layout": "--megatron-layout", "fqns": "--fqns"}


def _versus_optimal_lines(plan: Plan) -> list[str]:
    """A given split's distance from the optimal plan:
    bottleneck and step ratios, memory headroom per rank."""
    v = plan.versus_optimal
    given = v.get("given")
    shown = f"{len(given)} parts" if v.get("given_as") == "fqns" and isinstance(given, list) else given
    lines = [f"given split ({GIVEN_AS.get(v.get('given_as', ''), 'given')} {shown}) against the optimal plan "
             "under the same options:"]
    if v.get("optimal_boundaries") is None:
        lines.append(f"  no split fits the memory limits, so there is no optimal plan to compare with: "
                     f"{v.get('optimal_infeasible', '')}")
    else:
        lines.append(f"  optimal boundaries {v['optimal_boundaries']}; bottleneck {ms(plan.bottleneck_s)} vs "
                     f"{ms(v['optimal_bottleneck_s'])} ms = {ratio(v['bottleneck_ratio'])}x; predicted step "
                     f"{ms(plan.predicted_step_s)} vs {ms(v['optimal_predicted_step_s'])} ms = "
                     f"{ratio(v['step_ratio'])}x")
        if any(room is not None and room < 0 for room in v["memory_headroom_bytes"]):
            lines.append("  the given split does not fit in memory (negative headroom below) and the optimal "
                         "plan does, so a ratio under 1 is the price of fitting")
    optimal_need = v.get("optimal_rank_memory_bytes") or [None] * len(v["rank_memory_bytes"])
    rows = [[r, mib(need), mib(limit) if limit is not None else "none",
             mib(room) if room is not None else "", mib(opt)]
            for r, (need, limit, room, opt) in enumerate(zip(v["rank_memory_bytes"], v["memory_limit_bytes"],
                                                             v["memory_headroom_bytes"], optimal_need))]
    table = format_table(["rank", "need MiB", "limit MiB", "headroom MiB", "optimal needs MiB"], rows,
                         right=[True] * 5)
    lines.extend("  " + line for line in table.splitlines())
    return lines


# What each row of a comparison is, printed under the table: every "x" figure names its baseline
BASELINES = {
    "optimal": "optimal: this tool's split (exact min-max under the memory limits)",
    "uniform": "uniform: DeepSpeed partition_method='uniform', equal layers (E and L counted as layers)",
    "parameters": "parameters: DeepSpeed partition_method='parameters', equal parameter counts",
}


def memory_over_bytes(plan: Plan) -> float | None:
    """How far the fullest rank is over its memory limit (<= 0: it fits); None without a limit."""
    limits: dict[int, float] = {}
    for st in plan.stages:
        if st.memory_limit_bytes is not None:
            limits[st.rank] = min(limits.get(st.rank, float("inf")), st.memory_limit_bytes)
    if not limits:
        return None
    return max(need - limits[r] for r, need in enumerate(plan.rank_memory_bytes) if r in limits)


def gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f} GiB"


def compare_table(plans: dict[str, Plan], not_applicable: dict[str, str] | None = None) -> str:
    """Every method and peer default side by side with ratios to optimal; under a memory limit each row says
    whether it fits, and by how much it does not; then a line per row saying what it is, and why a peer's rule
    gave no row."""
    from stageplan.planning.search import PEERS

    ref = plans["optimal"]
    overs = {name: memory_over_bytes(p) for name, p in plans.items()}
    limited = any(v is not None for v in overs.values())
    headers = ["method", "boundaries", "bottleneck ms", "x optimal", "step ms", "x optimal", "efficiency",
               "max mem MiB", *(["fits the limit"] if limited else [])]
    rows = []
    for name, p in plans.items():
        over = overs[name]
        fits = [] if not limited else [
            "-" if over is None else "yes" if over <= 0 else f"NO, {gib(over)} over"]
        rows.append([name, " ".join(map(str, p.boundaries)), ms(p.bottleneck_s),
                     ratio(p.bottleneck_s / ref.bottleneck_s),
                     ms(p.predicted_step_s), ratio(p.predicted_step_s / ref.predicted_step_s),
                     ratio(p.balance_efficiency), mib(max(p.rank_memory_bytes)), *fits])
    lines = [format_table(headers, rows, right=[False, False] + [True] * (len(headers) - 2))]
    over_rows = [n for n, v in overs.items() if v is not None and v > 0]
    if over_rows:
        lines.append(f"over the memory limit: {', '.join(over_rows)} (would not run: priced as if the "
                     "memory were there)")
    lines.append("x optimal = the row's time / the optimal row's (above 1: slower than optimal)")
    described = {**BASELINES, **{k: f"{k}: {v}" for k, v in PEERS.items()}}
    lines.extend(described.get(name, name) for name in plans)
    lines.extend(f"{name}: not applicable ({why})" for name, why in (not_applicable or {}).items())
    return "\n".join(lines)


def _replicas_line(report: RunReport) -> str | None:
    """With data-parallel replicas: the mesh, the sharding, and per rank of every replica the sync it waited
    for against the plan's and what it held against the plan's (parameters, gradients, shards, states)."""
    mesh = report.meta.get("mesh")
    if not isinstance(mesh, dict) or int(mesh.get("dp", 1)) <= 1:
        return None
    rows = sorted([*report.ranks, *report.replicas], key=lambda r: r.get("global_rank", 0))

    def held(r: dict[str, Any]) -> str:
        got, want = r.get("measured_memory_by_kind") or {}, r.get("predicted_memory_by_kind") or {}
        kinds = ("params", "grads", "master", "optimizer")
        g = sum(float(got.get(k, 0)) for k in kinds)
        w = sum(float(want.get(k, 0)) for k in kinds)
        return f"{mib(g)}/{mib(w)} MiB"

    per = "; ".join(f"({r['mesh']['pp']},{r['mesh']['dp']}) {ms(r.get('measured_dp_sync_s'))}/"
                    f"{ms(r.get('predicted_dp_sync_s'))} ms, {held(r)}" for r in rows if r.get("mesh"))
    return (f"replicas: mesh {mesh['pp']} x {mesh['dp']} (pp x dp), {report.meta.get('sharding', 'ddp')}; "
            f"per rank (pp,dp) data-parallel sync measured/predicted, parameters+gradients+shards+states "
            f"held/predicted: {per}")


def _tensor_line(report: RunReport) -> str | None:
    """With tensor-parallel shards: the mesh, and per rank of every shard the all-reduces it issued in one
    step against the cost model's count, forward and backward."""
    mesh = report.meta.get("mesh")
    if not isinstance(mesh, dict) or int(mesh.get("tp", 1)) <= 1:
        return None
    rows = sorted([*report.ranks, *report.replicas], key=lambda r: r.get("global_rank", 0))

    def pair(counts: Any) -> str:
        return f"{counts['forward']}+{counts['backward']}" if isinstance(counts, dict) else "-"

    per = "; ".join(f"({r['mesh']['pp']},{r['mesh'].get('tp', 0)}) {pair(r.get('measured_tp_collectives'))}/"
                    f"{pair(r.get('predicted_tp_collectives'))}" for r in rows if r.get("mesh"))
    return (f"tensor parallel: mesh {mesh['pp']} x {mesh['tp']} (pp x tp); per rank (pp,tp) all-reduces in a "
            f"step, forward+backward, counted/predicted: {per}")


def run_table(report: RunReport, *, explain: bool = False) -> str:
    """Predicted vs measured, per rank and for the step, with ratios; then the check result. A line says one
    thing: the details (layers inside the schedule, the chunk overhead, the compute ratio in two, the tied
    all-reduce, the optimizer step, the waits on receives, the calls after idle) come with ``explain``, a
    heading and a line per rank; the run's JSON has every figure."""
    headers = ["rank", "stages", "compute ms pred", "compute ms meas", "ratio", "(cpu ms)", "idle ms pred",
               "idle ms meas", "act MiB pred", "act MiB meas", "ratio"]
    rows = []
    for r in report.ranks:
        rows.append([r["rank"], ",".join(map(str, r["stages"])), ms(r["predicted_compute_s"]),
                     ms(r["measured_compute_s"]),
                     ratio(r.get("compute_ratio")), ms(r.get("measured_compute_cpu_s")),
                     ms(r["predicted_idle_s"]), ms(r["measured_idle_s"]),
                     mib(r["predicted_peak_activation_bytes"]), mib(r["measured_peak_activation_bytes"]),
                     ratio(r.get("activation_ratio"))])
    lines = [format_table(headers, rows)]
    lines.append(
        f"step: predicted {ms(report.predicted_step_s)} ms, measured {ms(report.measured_step_s)} ms "
        f"(IQR {ms(report.measured_step_iqr_s)}), ratio {ratio(report.step_ratio)}; "
        f"bubble predicted {100 * report.predicted_bubble_fraction:.1f}%, measured "
        f"{100 * report.measured_bubble_fraction:.1f}%; {report.samples_per_s:.1f} samples/s; load average "
        f"{figure(report.meta.get('load_average_1min'), '.2f')}"
    )
    for extra in (_replicas_line(report), _tensor_line(report)):
        if extra:
            lines.append(extra)
    part = report.meta.get("partial")
    if isinstance(part, dict):
        skipped = ", ".join(part.get("skipped") or [])
        lines.append(f"partial: {part.get('reason', 'interrupted')} after {part.get('steps_measured')} of "
                     f"{part.get('steps_asked')} measured steps"
                     + (f"; skipped: {skipped}" if skipped else ""))
    # every process of the run: each replica's and each shard's ranks too
    distorted = run_contention(report.meta, len(report.ranks) + len(report.replicas))
    if distorted:
        lines.append(f"warning: {distorted}")
    if "cpus_per_rank" in report.meta:
        placed = report.meta["cpus_per_rank"]
        lines.append("CPUs per rank: " + ("; ".join(f"rank {r} on {','.join(map(str, c))}" if c
                                                    else f"rank {r} not pinned" for r, c in enumerate(placed))
                                          if any(placed) else "not pinned (the OS places the ranks)"))
    plan = report.plan
    lines.append(f"plan: {plan.get('method')} {plan.get('schedule')} boundaries {plan.get('boundaries')}, "
                 f"{plan.get('num_microbatches')} microbatches; compute per microbatch")
    details = _run_details(report)
    if explain:
        for heading, rows_ in details:
            lines.append(heading)
            lines.extend(f"  {row}" for row in rows_)
    elif details:
        lines.append(f"--explain adds: {', '.join(h.split(' (')[0].rstrip(':') for h, _ in details)}")
    if report.check is not None:
        c = report.check
        verdict = "PASS" if c["passed"] else "FAIL"
        grads = (f", max gradient diff {figure(c.get('max_grad_diff'))} at {c.get('worst_grad') or '-'} "
                 f"over {c['grads_compared']} gradients" if c.get("grads_compared") else "")
        lines.append(f"check: {verdict} (max loss diff {figure(c.get('max_loss_diff'))}, max param diff "
                     f"{figure(c.get('max_param_diff'))} "
                     f"at {c.get('worst_param') or '-'}, {c['params_compared']} parameters compared{grads})")
        if c.get("grads_missing"):
            lines.append(f"gradients on one side only: {', '.join(c['grads_missing'][:5])}")
        if c.get("hint"):
            lines.append(f"hint: {c['hint']}")
    return "\n".join(lines)


def _run_details(report: RunReport) -> list[tuple[str, list[str]]]:
    """The run's detail sections: a heading each, and its lines (a rank, or a layer, a line)."""
    out: list[tuple[str, list[str]]] = []
    ranks = report.ranks
    if report.layers:
        alone = any(x.get("retimed_forward_s") is not None for x in report.layers)
        table = format_table(["layer", "name", "stage", "rank", "forward", "backward"]
                             + (["alone after: forward", "backward"] if alone else []),
                             [[x["index"], x["name"], x["stage"], x["rank"], ms(x["measured_forward_s"]),
                               ms(x["measured_backward_s"])]
                              + ([ms(x.get("retimed_forward_s")), ms(x.get("retimed_backward_s"))]
                                 if alone else [])
                              for x in report.layers])
        out.append(("layers inside the schedule (ms per microbatch, median over the clock's steps; what "
                    "stageplan calibrate starts from):", table.splitlines()))
        out.append(("chunk overhead outside the layers (ms per microbatch, forward + backward):",
                    [f"rank {r['rank']} {ms(r.get('measured_overhead_forward_s'))} + "
                     f"{ms(r.get('measured_overhead_backward_s'))}" for r in ranks]))
    if any(r.get("retimed_compute_s") is not None for r in ranks):
        out.append(("compute ratio in two (compute ms per microbatch from the rank's layers timed alone "
                    "after the run, as the profiler times them):",
                    [f"rank {r['rank']} {ms(r.get('retimed_compute_s'))}, the machine now x"
                     f"{ratio(r.get('machine_ratio'))} the profile's, inside the pipeline x"
                     f"{ratio(r.get('pipeline_ratio'))} alone" for r in ranks]))
    if any(r.get("predicted_tied_sync_s") for r in ranks):
        out.append(("tied gradients' all-reduce (ms per step; a rank that gets there first waits for the "
                    "last one's backward, which the prediction counts as idle):",
                    [f"rank {r['rank']} predicted {ms(r.get('predicted_tied_sync_s'))}, measured "
                     f"{ms(r.get('measured_tied_sync_s'))}" for r in ranks]))
    if any(r.get("measured_optimizer_step_s") is not None for r in ranks):
        out.append(("optimizer step (ms per step, after the tied sum; what stageplan calibrate scales each "
                    "rank's layers' figures to):",
                    [f"rank {r['rank']} predicted {ms(r.get('predicted_optimizer_step_s'))}, measured "
                     f"{ms(r.get('measured_optimizer_step_s'))}" for r in ranks]))
    if any(r.get("measured_receive_wait_s") is not None for r in ranks):
        out.append(("waits on receives (ms per step; blocked on another rank's activation or gradient, part "
                    "of the idle time):",
                    [f"rank {r['rank']} predicted {ms(r.get('predicted_receive_wait_s'))}, measured "
                     f"{ms(r.get('measured_receive_wait_s'))}" for r in ranks]))
    if any(r.get("measured_after_idle_calls") is not None for r in ranks):
        out.append((f"calls after idle (a chunk call after >= {RESUME_GAP_S * 1e3:g} ms computing nothing):",
                    [f"rank {r['rank']} {figure(r.get('predicted_after_idle_calls'))} / "
                     f"{figure(r.get('measured_after_idle_calls'))} after idle (calls a step, predicted / "
                     "measured)" for r in ranks]
                    + [f"rank {r['rank']} after idle x{ratio(r.get('after_idle_ratio')) or '-'} the planned "
                       "pace" for r in ranks]
                    + [f"rank {r['rank']} back to back x{ratio(r.get('back_to_back_ratio')) or '-'} the "
                       "planned pace" for r in ranks]
                    + [f"rank {r['rank']} a call after idle took "
                       + ("-" if r.get("after_idle_excess_s") is None
                          else f"{ms(r['after_idle_excess_s'])} ms")
                       + " beyond a back-to-back one's pace" for r in ranks]))
    return out


def compare_run_table(result: dict[str, Any]) -> str:
    """The `stageplan compare` table: predicted and measured step, speed-up over uniform (DeepSpeed's equal
    layers), efficiency, memory; then what each row is, a warning where other work distorted the runs, and why
    a measured slow-down goes against a predicted speed-up."""
    from stageplan.planning.search import PEERS

    headers = ["method", "boundaries", "step ms pred", "step ms meas", "speed-up vs uniform", "balance eff.",
               "peak MiB per rank"]
    rows = []
    for name, r in result["methods"].items():
        measured = r.get("measured_step_s")
        rows.append([name, " ".join(map(str, r["boundaries"])), ms(r["predicted_step_s"]),
                     ms(measured) if measured is not None else "-",
                     ratio(r["speedup_over_uniform"]) if r.get("speedup_over_uniform") is not None else "-",
                     ratio(r["balance_efficiency"]), " / ".join(mib(x) for x in r["peak_memory_bytes"])])
    lines = [format_table(headers, rows, right=[False, False, True, True, True, True, True])]
    runs = int(result.get("runs") or 1)
    if runs > 1 and not result.get("identical"):
        lines.append(f"measured: each plan's median over {runs} runs, the plans in turns; speed-up: the "
                     "median of the speed-ups of runs side by side")
    if result.get("identical"):
        lines.append("all methods give the same boundaries: nothing to compare, so nothing was run "
                     "(try more --stages, another schedule, or a model whose layers differ in cost)")
    lines.append("speed-up vs uniform = uniform's measured step / the row's (above 1: faster than uniform)")
    described = {**BASELINES, **{k: f"{k}: {v}" for k, v in PEERS.items()}}
    lines.extend(described.get(name, name) for name in result["methods"])
    skipped = result.get("not_applicable") or {}
    lines.extend(f"{name}: not applicable ({why})" for name, why in skipped.items())
    distorted = next((r["distorted"] for r in result["methods"].values() if r.get("distorted")), None)
    if distorted:
        lines.append(f"warning: {distorted}")
    opt, uni = result["methods"].get("optimal"), result["methods"].get("uniform")
    if opt and uni and uni.get("predicted_step_s") and opt.get("predicted_step_s"):
        why = slower_explained(opt.get("speedup_over_uniform"),
                               uni["predicted_step_s"] / opt["predicted_step_s"], distorted)
        if why:
            lines.append(f"note: {why}")
    return "\n".join(lines)


def tune_table(result: dict[str, Any], *, rounds: bool = True) -> str:
    """What `stageplan tune` found: each round (unless ``rounds`` is off, where its progress printed them),
    the final and the uniform plan's fresh runs, the speed-up, and a warning where other work distorted a
    run."""
    runs = int(result.get("runs") or 1)
    lines = []
    for k, r in enumerate(result["rounds"] if rounds else [], 1):
        lines.append(f"round {k}: boundaries {r['boundaries']}, predicted "
                     f"{r['predicted_step_s'] * 1e3:.1f} ms, measured {r['measured_step_s'] * 1e3:.1f} ms"
                     + (f" (the median of {runs} runs)" if runs > 1 else ""))
    how = "a fresh run" if runs == 1 else f"the median of {runs} fresh runs, the two plans in turns"
    for name in ("final", "uniform"):
        r = result[name]
        lines.append(f"{name}: boundaries {r['boundaries']}, predicted {r['predicted_step_s'] * 1e3:.1f} ms, "
                     f"measured {r['measured_step_s'] * 1e3:.1f} ms ({how})")
    speedup = result.get("final_over_uniform_measured")
    error = result.get("final_prediction_error")
    lines.append(f"final / uniform measured: {figure(speedup, '.3f')}x faster (uniform: DeepSpeed's equal "
                 f"layers); final prediction error {figure(error, '+.1%')}")
    distorted = next((r["distorted"] for r in [*result["rounds"], result["final"], result["uniform"]]
                      if r.get("distorted")), None)
    if distorted:
        lines.append(f"warning: {distorted}")
    final, uniform = result["final"]["predicted_step_s"], result["uniform"]["predicted_step_s"]
    why = slower_explained(speedup, uniform / final if final else None, distorted)
    if why:
        lines.append(f"note: {why}")
    if "calibrated_on" in result:  # tune.json files written before tune judged its two errors lack them
        lines.append(format_tune_errors(result))
    return "\n".join(lines)


def link_table(link: dict[str, Any]) -> str:
    """A measured link (LINK.json), a figure a line."""
    pairs = link.get("pairs") or []
    d = int(link.get("data_parallel") or 1)
    # with replicas, the point-to-point probes ran on replica 0's pipeline (stage 0's replicas where p = 1)
    p = link.get("pipeline_parallel")
    mesh = (f" of {link.get('num_ranks', '?')} laid out {p} pp x {d} dp, "
            + ("stage 0's replicas" if p == 1 else "replica 0's pipeline")) if d > 1 else ""
    lines = [f"link ({link.get('backend', '?')}, {len(pairs) + 1 if pairs else '?'} ranks{mesh}, median over "
             f"{len(pairs)} pairs):",
             f"  latency {link['latency_s'] * 1e6:.1f} us",
             f"  bandwidth {link['bandwidth_bytes_per_s'] / 1e9:.3g} GB/s one way"]
    if link.get("exchange_s") is not None:
        lines.append(f"  fused send/receive exchange {link['exchange_s'] * 1e6:.1f} us")
    if link.get("action_s"):
        lines.append(f"  torch's schedule {link['action_s'] * 1e6:.0f} us around each chunk action")
    if link.get("chunk_forward_s") is not None and link.get("chunk_backward_s") is not None:
        lines.append(f"  PipelineStage {link['chunk_forward_s'] * 1e6:.0f} us inside each chunk's forward, "
                     f"{link['chunk_backward_s'] * 1e6:.0f} us inside its backward")
    if link.get("allreduce_s"):
        lines.append("  all-reduce " + ", ".join(f"{t * 1e3:.2f} ms at {n / 2**10:.0f} KiB" for n, t in
                                                 zip(link["allreduce_sizes"], link["allreduce_s"])))
    if link.get("dp_allreduce_s") and link.get("dp_allreduce_bandwidth_bytes_per_s"):
        # the ring constants back to the fit a + n / B at the d they were timed at (link.dp_allreduce_probe)
        d = int(link.get("dp_allreduce_ranks") or 2)
        fixed = float(link["dp_allreduce_latency_s"]) * 2 * (d - 1)
        rate = float(link["dp_allreduce_bandwidth_bytes_per_s"]) * d / (2 * (d - 1))
        groups = link.get("dp_allreduce_groups")
        lines.append(f"  data-parallel all-reduce over {d} replicas"
                     + (f", {groups} groups at once" if groups else "")
                     + f", measured (fit {fixed * 1e3:.3f} ms + bytes / {rate / 1e9:.3g} GB/s): "
                     + ", ".join(f"{t * 1e3:.2f} ({(fixed + n / rate) * 1e3:.2f}) ms at {_kib(n)}"
                                 for n, t in zip(link["dp_allreduce_sizes"], link["dp_allreduce_s"])))
    if link.get("dp_sync_fit") and link.get("dp_sync_s"):
        units = int(link.get("dp_sync_units") or 1)
        lines.append(f"  each sharding mode's own sync over {link.get('dp_sync_ranks')} replicas, a module "
                     f"of {units} units, measured (fit) ms:")
        for kind, (fixed, rate) in link["dp_sync_fit"].items():
            # FSDP2's fixed cost is stored per unit (link.dp_sync_fields): the probe paid it once a unit
            whole = fixed * (units if kind.startswith("fsdp") else 1)
            many = (link.get("dp_sync_many_s") or {}).get(kind)
            more = int(link.get("dp_sync_many_units") or 0), int(link.get("dp_sync_many_size") or 0)
            lines.append(f"    {kind}: " + ", ".join(
                f"{t * 1e3:.2f} ({(whole + n / rate) * 1e3:.2f}) at {_kib(n)}"
                for n, t in zip(link["dp_sync_sizes"], link["dp_sync_s"].get(kind, [])))
                + ("" if many is None else f"; {more[0]} units: {many * 1e3:.2f} "
                   f"({(fixed * more[0] + more[1] / rate) * 1e3:.2f}) at {_kib(more[1])}"))
    return "\n".join(lines)


def _kib(n: float) -> str:
    """A message size in KiB below 1 MiB, else in MiB."""
    return f"{n / 2**10:.0f} KiB" if n < 2**20 else f"{n / 2**20:.0f} MiB"


GiB = 1024.0**3


def layout_table(layout: Layout, *, top: int | None = None) -> str:
    """The ranked layouts, one line for each family of rejected candidates and why, the search's counts and
    margin, the best one's memory per rank, and (where given) the user's own layout beside it."""
    from stageplan.formats.layout import STEP_PARTS

    shown = layout.candidates[:top] if top else layout.candidates[:10]
    rows = []
    for i, c in enumerate(shown, 1):
        parts = c.step_parts
        rows.append([i, c.degrees, f"{c.step_s:.3f}", format_bytes(c.peak_memory_bytes or 0.0),
                     figure(c.tokens_per_s_per_device, ".0f"), figure(c.mfu, ".1%"), figure(c.hfu, ".1%"),
                     " ".join(f"{k.removesuffix('_s')} {parts.get(k, 0.0):.2f}" for k in STEP_PARTS
                              if parts.get(k, 0.0) > 0)])
    limit = "" if layout.memory_limit_bytes is None else f", {layout.memory_limit_bytes / GiB:.0f} GiB each"
    lines = [f"layouts of {layout.num_devices} devices ({layout.devices_per_node} a node{limit}), global "
             f"batch {layout.global_batch_size}",
             format_table(["#", "layout", "step s", "fullest device", "tok/s/dev", "MFU", "HFU",
                           "step parts (s)"],
                          rows, right=[True, False, True, True, True, True, True, False])]
    counts = layout.counts
    margin = layout.margin
    lines.append(f"searched {counts.get('grid', 0)}: priced {counts.get('priced', 0)}, pruned by the step "
                 f"bound {counts.get('pruned_by_time', 0)}, by the memory bound "
                 f"{counts.get('pruned_by_memory', 0)}, infeasible {counts.get('infeasible', 0)}"
                 + ("" if margin is None else f"; the best is {margin:.1%} faster than the runner-up"))
    listed = {f"tp{c.tensor_parallel} pp{c.pipeline_parallel} dp{c.data_parallel}" for c in shown}
    for r in layout.rejected:
        if r["family"] in listed:
            continue  # its best candidate is in the table
        why = []
        if r.get("memory"):
            over = r.get("least_over_bytes")
            why.append(f"{r['memory']} over the memory limit"
                       + (f" (by {format_bytes(over)} at least)" if isinstance(over, (int, float)) else ""))
        if r.get("time"):
            bound = r.get("least_step_bound_s")
            ratio = f" (step bound {bound / layout.best.step_s:.2f}x the best's step)" if bound else ""
            why.append(f"{r['time']} slower{ratio}")
        if r.get("rule"):
            why.append(f"{r['rule']} not runnable: {'; '.join(r.get('rules', []))}")
        if why:
            lines.append(f"  {r['family']}: " + ", ".join(why))
    best = layout.best
    lines.append(f"best {best.degrees}: fullest device {format_bytes(best.peak_memory_bytes or 0.0)} = "
                 + ", ".join(f"{k} {format_bytes(v)}" for k, v in best.memory_bytes.items() if v > 0)
                 + (f"; groups across nodes: {', '.join(best.spans_nodes)}" if best.spans_nodes else ""))
    if best.rank_memory_bytes:
        lines.append("  per pipeline rank: " + ", ".join(format_bytes(m) for m in best.rank_memory_bytes))
    if layout.given is not None:
        g = layout.given
        verdict = "fits" if g.feasible else f"does not fit: {g.reason}"
        lines.append(f"given {g.degrees}: step {g.step_s:.3f} s ({g.step_s / best.step_s:.3f}x the best), "
                     f"fullest device {format_bytes(g.peak_memory_bytes or 0.0)}, {verdict}"
                     + (f", MFU {g.mfu:.1%}" if g.mfu is not None else ""))
        worst = max(STEP_PARTS, key=lambda k: g.step_parts.get(k, 0.0) - best.step_parts.get(k, 0.0))
        diff = g.step_parts.get(worst, 0.0) - best.step_parts.get(worst, 0.0)
        if diff > 0:
            lines.append(f"  the step's term that differs most from the best's: {worst.removesuffix('_s')} "
                         f"+{diff:.3f} s")
        kinds = set(g.memory_bytes) | set(best.memory_bytes)
        heavier = max(kinds, key=lambda k: g.memory_bytes.get(k, 0.0) - best.memory_bytes.get(k, 0.0),
                      default=None)
        if heavier is not None and g.memory_bytes.get(heavier, 0.0) > best.memory_bytes.get(heavier, 0.0):
            lines.append(f"  the memory kind that differs most: {heavier} "
                         f"+{format_bytes(g.memory_bytes[heavier] - best.memory_bytes.get(heavier, 0.0))}")
    lines.extend(note_line(n) for n in layout.notes)
    return "\n".join(lines)


def format_tune_errors(result: dict[str, Any]) -> str:
    """tune's two errors (:func:`stageplan.tuning.judged`): the final plan's fresh runs on the split it was
    calibrated on (repeatability), then every other split it ran, priced from the calibrated profile against
    that split's measurement (prediction), with their median and worst.

    >>> print(format_tune_errors({"repeatability_error": 0.05, "calibrated_on": [0, 3, 4],
    ...     "prediction_errors": [{"split": "uniform", "boundaries": [0, 2, 4], "predicted_step_s": 0.016,
    ...     "measured_step_s": 0.018, "error": 0.125}], "prediction_error_median": 0.125,
    ...     "prediction_error_worst": 0.125}))
    repeatability (the final plan, fresh runs of the split calibrated on [0, 3, 4]): +5.0%
    prediction (other splits, priced from the calibrated profile): median 12.5%, worst 12.5% over 1
      uniform [0, 2, 4]: predicted 16.0 ms, measured 18.0 ms (+12.5%)
    """
    same = result.get("repeatability_error")
    head = f"repeatability (the final plan, fresh runs of the split calibrated on {result['calibrated_on']}):"
    moved = " the final plan moved after the last calibration: judged as a prediction"
    lines = [head + (moved if same is None else f" {same:+.1%}")]
    errors = result.get("prediction_errors") or []
    if not errors:
        lines.append("prediction: tune ran no split but the one it calibrated on (the uniform split is it)")
        return "\n".join(lines)
    lines.append(f"prediction (other splits, priced from the calibrated profile): median "
                 f"{result['prediction_error_median']:.1%}, worst {result['prediction_error_worst']:.1%} "
                 f"over {len(errors)}")
    lines += [f"  {e['split']} {e['boundaries']}: predicted {e['predicted_step_s'] * 1e3:.1f} ms, measured "
              f"{e['measured_step_s'] * 1e3:.1f} ms ({e['error']:+.1%})" for e in errors]
    return "\n".join(lines)
