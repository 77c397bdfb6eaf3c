"""layout(): how to lay out a model on N devices, from stored profiles (no torch) or from a model spec
(estimated per microbatch size and tensor-parallel degree, with torch)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import replace
from importlib import resources
from typing import Any

from stageplan.errors import StageplanError
from stageplan.formats.interop import boundaries_from_megatron, named_layers
from stageplan.formats.layout import Candidate, Layout
from stageplan.formats.profile import Profile
from stageplan.planning.layouts import (
    DEFAULT_MICROBATCH_SIZES,
    DEFAULT_RECOMPUTE,
    DEFAULT_SCHEDULES,
    DEFAULT_TENSOR_PARALLEL,
    Network,
    score_given,
    search_layouts,
)
from stageplan.planning.sharding import SHARDINGS
from stageplan.units import parse_bandwidth, parse_bytes

# What --given takes: Megatron's and torchtitan's names for the degrees and options.
_GIVEN_KEYS = {"tp": "t", "pp": "p", "dp": "d", "mbs": "b", "b": "b", "sharding": "sharding", "vp": "v",
               "v": "v", "schedule": "schedule", "sp": "sp", "recompute": "recompute", "layout": "layout"}


def _default_network(profiles: Sequence[Profile], devices_per_node: int, intra: float | str | None,
                     inter: float | str | None) -> Network:
    """The links: as given, else the estimated GPU's from
    gpus.json (within a node, and its node's network)."""
    gpu = None
    for p in profiles:
        gpu = (p.meta.get("estimate") or {}).get("gpu") or gpu
    table = json.loads(resources.files("stageplan").joinpath("gpus.json").read_text(encoding="utf-8"))
    row = table["gpus"].get(str(gpu).lower()) if gpu else None
    if intra is None and row is not None:
        intra = float(row["intra_node"]["bandwidth"])
    if inter is None and row is not None:
        inter = float(row.get("inter_node", table["inter_node_default"])["bandwidth"])
    if intra is None or inter is None:
        raise StageplanError("a layout prices its links: give --intra-node-bandwidth and "
                             "--inter-node-bandwidth (e.g. 450GB/s and 50GB/s), or lay out an estimate for a "
                             "GPU (--device estimate:GPU), whose links are known")
    return Network(devices_per_node, parse_bandwidth(intra), parse_bandwidth(inter))


def _with_link(net: Network, link: Mapping[str, Any] | str | os.PathLike[str], notes: list[str]) -> Network:
    """``net`` with the measured link's all-reduce for replicas within a node, and the note saying so; a link
    that timed no all-reduce is refused (its point-to-point figure would replace a node's collective)."""
    from stageplan.formats.link import load_link
    from stageplan.planning.costs import data_parallel_link

    measured = load_link(link)
    where = f"link file {str(link)!r}" if not isinstance(link, Mapping) else "the link"
    # at the rank count the constants were timed at (any d > 1 reads the same constants; this one words the
    # note without a scaling the layout does per candidate)
    own = measured.get("dp_allreduce_bandwidth_bytes_per_s") is not None
    timed = measured.get("dp_allreduce_ranks" if own else "allreduce_ranks")
    fields, note = data_parallel_link(int(timed or 2), measured)
    if not fields:
        raise StageplanError(f"{where} timed no all-reduce to price the replicas' sync with; measure one "
                             "with stageplan link --ranks N --data-parallel D")
    notes.append(f"{note}; for replicas within a node, scaled as a ring to each d (across nodes, the "
                 "inter-node link)")
    fits = measured.get("dp_sync_fit") or {}
    if fits:
        notes.append(f"each sharding mode's own sync, timed by the link over {measured['dp_sync_ranks']} "
                     "replicas, prices the layouts of that d within a node")
    return replace(net, dp_bandwidth_bytes_per_s=fields["dp_bandwidth_bytes_per_s"],
                   dp_latency_s=fields["dp_latency_s"],
                   dp_sync_fit=tuple((k, float(a), float(b)) for k, (a, b) in sorted(fits.items())),
                   dp_sync_ranks=int(measured.get("dp_sync_ranks") or 0))


def parse_given(text: str) -> dict[str, Any]:
    """``"tp=4,pp=8,dp=2,mbs=1,sharding=zero1,vp=5,sp=1,layout=Et*2|t*3,L"``: the user's own layout. The
    Megatron layout string comes last (it holds commas).

    >>> parse_given("tp=4,pp=8,dp=2,mbs=1,sharding=zero1,vp=5")
    {'t': 4, 'p': 8, 'd': 2, 'b': 1, 'sharding': 'zero1', 'v': 5}
    """
    out: dict[str, Any] = {}
    rest = text
    if "layout=" in text:
        rest, layout = text.split("layout=", 1)
        out["layout"] = layout
        rest = rest.rstrip(",")
    for item in filter(None, (x.strip() for x in rest.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key not in _GIVEN_KEYS:
            raise StageplanError(f"--given takes key=value pairs among {', '.join(sorted(_GIVEN_KEYS))}, got "
                                 f"{item!r}; e.g. --given tp=4,pp=8,dp=2,mbs=1,sharding=zero1")
        name = _GIVEN_KEYS[key]
        if name in ("t", "p", "d", "b", "v"):
            if not value.isdigit() or int(value) < 1:
                raise StageplanError(f"--given {key} must be an integer >= 1, got {value!r}")
            out[name] = int(value)
        elif name in ("sp", "recompute"):
            out[name] = value.lower() in ("1", "true", "yes", "full")
        else:
            out[name] = value
    return out


def layout(
    profile_or_model: Profile | str | os.PathLike[str] | Sequence[Profile | str | os.PathLike[str]],
    num_devices: int, *, global_batch_size: int, memory_limit: float | str | None = None,
    devices_per_node: int = 8, device: str | None = None, options: Mapping[str, Any] | None = None,
    precision: str = "bf16-mixed", grad_dtype: str = "param", optimizer: str = "adam",
    intra_node_bandwidth: float | str | None = None, inter_node_bandwidth: float | str | None = None,
    tensor_parallel: Sequence[int] | None = None, sequence_parallel: bool = False,
    microbatch_sizes: Sequence[int] | None = None, schedules: Sequence[str] | None = None,
    virtual_stages: Sequence[int] | None = None, recompute: Sequence[bool] | None = None,
    shardings: Sequence[str] | None = None, top: int = 10, given: str | None = None,
    context_parallel: int = 1, bounds: bool = True, progress: bool = False,
    pipeline_parallel: Sequence[int] | None = None,
    link: Mapping[str, Any] | str | os.PathLike[str] | None = None,
) -> Layout:
    """Choose pipeline, data- and tensor-parallel degrees, microbatching, schedule, recompute and sharding for
    ``num_devices`` devices, with the exact split inside each candidate (``stageplan.planning.layouts``).

    ``profile_or_model`` is a profile (or several: one per microbatch size, each at t = 1, or with
    ``meta["factory_options"]["tensor_parallel"]``), or a model spec ("hf" with ``options`` {"preset":
    ..., "seq_len": ...}, or "module:factory") profiled for ``device`` (an HF decoder is estimated per (b, t)
    for "estimate:GPU", or measured per (b, t) on "cpu"). ``pipeline_parallel`` limits the pipeline degrees
    tried. The default grid: t in {1, 2, 4, 8} up to a node, every p dividing N / t up to the layers, b in
    {1, 2, 4, 8}, GPipe, 1F1B and Interleaved1F1B with every valid v, recompute none or full, sharding ddp,
    zero1 or fsdp. ``given`` scores the user's own layout ("tp=4,pp=8,dp=2,mbs=1,
    sharding=zero1[,vp=5][,sp=1][,layout=MEGATRON_LAYOUT]") beside the best.

    ``link`` (a LINK.json from ``stageplan link``, or its dict) prices the sync of replicas within a node
    with the all-reduce it timed: the replicas' own (``--data-parallel D``), else the one over its pipeline's
    ranks, as a ring scaled to each d (:func:`stageplan.planning.costs.data_parallel_link`). A local probe
    says nothing of the link across nodes, and the pipeline's and tensor groups' links stay the network's.
    """
    if isinstance(context_parallel, bool) or not isinstance(context_parallel, int) or context_parallel != 1:
        raise StageplanError(f"context parallelism (cp = {context_parallel}) is not modelled by stageplan; "
                             "lay out with cp = 1, or shorten the sequence")
    tps = list(tensor_parallel or [t for t in DEFAULT_TENSOR_PARALLEL if t <= devices_per_node])
    over = [t for t in tps if isinstance(t, int) and t > devices_per_node]
    if over:  # before any profile is made
        raise StageplanError(f"tensor parallelism stays within a node: t = {over[0]} exceeds the "
                             f"{devices_per_node} devices per node; use --tensor-parallel "
                             f"{','.join(str(t) for t in tps if t <= devices_per_node) or 1}")
    bs = list(microbatch_sizes or DEFAULT_MICROBATCH_SIZES)
    notes: list[str] = []
    given_fields = parse_given(given) if given else None
    if given_fields:  # the user's degrees must be in the grid the profiles are made for
        tps = sorted(set(tps) | {given_fields.get("t", 1)})
        bs = sorted(set(bs) | {given_fields.get("b", 1)})
    profiles = _profiles(profile_or_model, device, options, bs, tps, notes, progress)
    if not any(t > 1 for (_, t) in profiles):
        if any(t > 1 for t in tps) and tensor_parallel:
            notes.append("the profiles are of the whole model (t = 1): tensor parallelism needs a profile of "
                         "each shard (stageplan layout hf --set preset=NAME --device estimate:GPU makes "
                         "them)")
        tps = [1]
    net = _default_network(list(profiles.values()), devices_per_node, intra_node_bandwidth,
                           inter_node_bandwidth)
    if link is not None:
        net = _with_link(net, link, notes)
    limit = parse_bytes(memory_limit) if memory_limit is not None else None
    result = search_layouts(
        profiles, num_devices, global_batch_size=global_batch_size, network=net, memory_limit_bytes=limit,
        precision=precision, grad_dtype=grad_dtype, optimizer=optimizer, tensor_parallel=tps,
        microbatch_sizes=bs, schedules=list(schedules or DEFAULT_SCHEDULES), virtual_stages=virtual_stages,
        recompute=list(recompute if recompute is not None else DEFAULT_RECOMPUTE),
        shardings=list(shardings or SHARDINGS), sequence_parallel=sequence_parallel, top=top, bounds=bounds,
        pipeline_parallel=pipeline_parallel)
    if given_fields:
        scored = _score_given(given_fields, profiles, result, net, limit, precision, grad_dtype, optimizer,
                              sequence_parallel)
        result = replace(result, given=scored)
    return replace(result, notes=(*notes, *result.notes))


def _score_given(fields: dict[str, Any], profiles: Mapping[tuple[int, int], Profile], result: Layout,
                 net: Network, limit: float | None, precision: str, grad_dtype: str, optimizer: str,
                 sequence_parallel: bool) -> Candidate:
    t, p = fields.get("t", 1), fields.get("p", 1)
    d = fields.get("d", result.num_devices // (t * p))
    if p * d * t != result.num_devices:
        raise StageplanError(f"--given's degrees multiply to {p} x {d} x {t} = {p * d * t}, not the "
                             f"{result.num_devices} devices; give tp, pp and dp whose product is "
                             f"{result.num_devices}")
    b = fields.get("b", 1)
    if result.global_batch_size % (b * d):
        raise StageplanError(f"--given's b x dp = {b} x {d} does not divide the global batch "
                             f"{result.global_batch_size}; change mbs or dp")
    v = fields.get("v", 1)
    schedule = fields.get("schedule") or ("Interleaved1F1B" if v > 1 else "1F1B")
    prof = profiles.get((b, t))
    boundaries = None
    if "layout" in fields and prof is not None:
        boundaries = boundaries_from_megatron(fields["layout"], prof.names,
                                              named_layers(prof.names, prof.meta))
    return score_given(profiles, result.num_devices, global_batch_size=result.global_batch_size, network=net,
                       memory_limit_bytes=limit, precision=precision, grad_dtype=grad_dtype,
                       optimizer=optimizer, t=t, p=p, d=d, b=b, schedule=schedule, v=v,
                       recompute=bool(fields.get("recompute", False)),
                       sharding=str(fields.get("sharding", "ddp")),
                       sequence_parallel=bool(fields.get("sp", sequence_parallel)), boundaries=boundaries)


def _profiles(source: Any, device: str | None, options: Mapping[str, Any] | None, bs: Sequence[int],
              tps: Sequence[int], notes: list[str], progress: bool) -> dict[tuple[int, int], Profile]:
    """The (b, t) profiles: stored ones as given, or made from a model spec."""
    items = list(source) if isinstance(source, (list, tuple)) else [source]
    stored = [x for x in items if isinstance(x, Profile) or (isinstance(x, (str, os.PathLike))
                                                              and str(x).endswith(".json"))]
    if len(stored) == len(items):
        out: dict[tuple[int, int], Profile] = {}
        for x in stored:
            prof = x if isinstance(x, Profile) else Profile.load(x)
            b = int(prof.meta.get("microbatch_size") or 1)
            t = int((prof.meta.get("factory_options") or {}).get("tensor_parallel") or 1)
            if (b, t) in out:
                raise StageplanError(f"two profiles at microbatch size {b} and tensor degree {t}; give one "
                                     "profile per (b, t)")
            out[(b, t)] = prof
        return out
    if len(items) != 1 or not isinstance(items[0], str):
        raise StageplanError("give stored profiles (PROFILE.json ...) or one model spec (e.g. hf --set "
                             "preset=llama3-70b), not both")
    spec, opts = items[0], dict(options or {})
    if device is None:
        raise StageplanError(f"laying out the model spec {spec!r} profiles it first: give --device (cpu, "
                             "cuda, or estimate:GPU such as estimate:h100-sxm)")
    from stageplan.profiling.shards import estimate_hf_profiles, profile_for_layout

    if spec == "hf":
        say = (lambda s: print(s, flush=True)) if progress else None
        profiles, more = estimate_hf_profiles(opts, device=device, microbatch_sizes=bs, tensor_parallel=tps,
                                              progress=say)
        notes.extend(more)
        return profiles
    if any(t > 1 for t in tps):
        notes.append(
            f"tensor parallelism is priced for HF decoders (hf --set preset=...), not {spec!r}: t = 1")
    b0 = min(bs)
    return {(b0, 1): profile_for_layout(spec, opts, device=device, microbatch_size=b0, progress=progress)}
