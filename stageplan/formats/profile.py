"""Profile / LayerProfile: per-layer measured costs, versioned JSON, DataFrame view (no torch)."""

from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

from stageplan._io import check_schema, is_number, read_json, write_json_atomic
from stageplan.errors import SchemaError

if TYPE_CHECKING:
    import pandas as pd

PROFILE_SCHEMA = "stageplan.profile/1"


@dataclass(frozen=True)
class LayerProfile:
    """Measured costs of one layer at the profiled microbatch size.

    - ``forward_s`` / ``backward_s``: median seconds per microbatch; backward is the layer's backward given a
      gradient of its outputs, weight gradients included (the last layer includes the loss).
    - ``forward_iqr_s`` / ``backward_iqr_s``: interquartile range of the repeats (the spread).
    - ``activation_bytes``: bytes saved for backward per microbatch (saved_tensors_hooks, deduplicated by
      storage, parameters excluded).
    - ``output_bytes``: bytes that cross to the next stage if a boundary falls after this layer (every tensor
      produced up to here and used later). The gradient coming back across that boundary has the same size.
    - ``param_bytes`` / ``param_count``: parameters this layer uses.
    - ``peak_bytes``: CUDA only, peak allocated bytes above the baseline during forward+backward (else None).
    - ``backward_accumulate_s``: the backward again with the parameter grads already filled, as for every
      microbatch after the first in a pipeline step (an add into .grad, where the first one hands its buffer
      over); None in profiles that did not measure it (then taken equal to ``backward_s``).
    - ``measured_as``: the name of the identical layer whose times and activation bytes this row reuses (that
      layer was measured, this one was not); None when this row was measured itself. Its output and
      parameter bytes are always its own.
    - ``optimizer_s``: per optimizer ("sgd", "momentum" = SGD with momentum 0.9, "adam", "adamw"), the median
      seconds of one ``optimizer.step()`` over this layer's parameters with gradients present, in torch's
      default implementation, after warm-up steps (estimates: bytes moved / memory bandwidth); None in
      profiles
      that did not measure it (the plan then says so and leaves the optimizer step out).
    """

    name: str
    forward_s: float
    backward_s: float
    activation_bytes: int
    output_bytes: int
    param_bytes: int
    param_count: int = 0
    forward_iqr_s: float = 0.0
    backward_iqr_s: float = 0.0
    peak_bytes: int | None = None
    backward_accumulate_s: float | None = None
    measured_as: str | None = None
    optimizer_s: dict[str, float] | None = None

    @property
    def time_s(self) -> float:
        return self.forward_s + self.backward_s

    def backward_per_microbatch_s(self, num_microbatches: int) -> float:
        """Mean backward seconds per microbatch over a step of m: one into empty grads, m - 1 accumulating."""
        acc = self.backward_s if self.backward_accumulate_s is None else self.backward_accumulate_s
        m = max(1, int(num_microbatches))
        return (self.backward_s + (m - 1) * acc) / m


# a layer's cost fields beyond the required ones: numbers >= 0 where present, and these may be null
_OPTIONAL_COSTS = ("param_count", "forward_iqr_s", "backward_iqr_s", "peak_bytes", "backward_accumulate_s")
_NULLABLE = ("peak_bytes", "backward_accumulate_s")


def _cost(v: Any) -> bool:
    return is_number(v) and v >= 0


def _check_meta(meta: dict[str, Any], source: str) -> None:
    """Refuse (SchemaError) the meta fields that planning reads when they are of the wrong kind: the batch and
    microbatch sizes, the named blocks, the optimizer step's fixed cost, the calibration record."""
    for key in ("batch_size", "microbatch_size"):
        v = meta.get(key)
        if v is not None and not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
            raise SchemaError(
                f"{source}: meta {key} = {v!r}; it must be an integer >= 1; re-profile the model")
    whole = meta.get("whole_model_s")
    if whole is not None and not _cost(whole):
        raise SchemaError(f"{source}: meta whole_model_s = {whole!r}; it must be seconds >= 0 or null; "
                          "re-profile the model")
    named = meta.get("named_layers")
    if named is not None and not (isinstance(named, list) and all(isinstance(n, str) for n in named)):
        raise SchemaError(f"{source}: meta named_layers = {named!r}; it must be a list of layer names; "
                          "re-profile the model")
    step = meta.get("optimizer_step")
    floors = step.get("floor_s") if isinstance(step, dict) else None
    if step is not None and not (
        isinstance(step, dict)
        and (floors is None or (isinstance(floors, dict) and all(_cost(v) for v in floors.values())))
    ):
        raise SchemaError(f"{source}: meta optimizer_step = {step!r}; its floor_s must map optimizer names "
                          "to seconds >= 0; re-profile the model")
    for key in ("calibration", "factory_options"):
        if meta.get(key) is not None and not isinstance(meta[key], dict):
            raise SchemaError(
                f"{source}: meta {key} = {meta[key]!r}; it must be an object; re-profile the model")
    if isinstance(meta.get("calibration"), dict):
        from stageplan.formats.link import check_allreduce

        check_allreduce(meta["calibration"], f"{source}: meta calibration", "calibrate the raw profile again")


@dataclass(frozen=True)
class TiedParameter:
    """One parameter the model shares under several FQNs (an embedding tied to the LM head), as the profiler
    records it in ``meta["tied"]``: its ``names``, the ``layers`` (indices, sorted, distinct) whose pieces use
    it, and its ``bytes`` in the profiled dtype. A pipeline that puts those layers on two or more ranks sums
    the copies' gradients across ranks every step."""

    names: tuple[str, ...]
    layers: tuple[int, ...]
    bytes: int


@dataclass(frozen=True)
class Profile:
    """A model's per-layer profile plus ``meta`` (how it was measured).

    ``meta["tied"]``, where present, lists the tied parameters (see :class:`TiedParameter`); profiles written
    before it was recorded have none, and are planned as a model without ties.
    """

    layers: tuple[LayerProfile, ...]
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))

    # -- views -------------------------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        return [layer.name for layer in self.layers]

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def tied(self) -> tuple[TiedParameter, ...]:
        """The tied parameters of ``meta["tied"]`` (none in profiles written before it was recorded)."""
        return _tied(self.meta.get("tied"), len(self.layers), "profile")

    @property
    def sum_vs_whole(self) -> float | None:
        """Sum of per-layer forward+backward divided by the uncut model's forward+backward."""
        whole = self.meta.get("whole_model_s")
        if not whole:
            return None
        return sum(layer.time_s for layer in self.layers) / float(whole)

    def to_pandas(self) -> pd.DataFrame:
        import pandas as pd

        rows = [asdict(layer) for layer in self.layers]
        return pd.DataFrame(rows, columns=[f.name for f in fields(LayerProfile)])

    def to_csv(self, path: str | os.PathLike[str]) -> None:
        import io

        from stageplan._io import write_atomic

        buf = io.StringIO()
        self.to_pandas().to_csv(buf, index=False)
        text = buf.getvalue().encode()
        write_atomic(path, lambda f: f.write(text))  # a unique temporary name, removed if the write fails

    def scaled(self, factors: list[float], backward_factors: list[float] | None = None) -> Profile:
        """A copy with each layer's forward times multiplied by its factor and its backward times by its
        backward factor (the same factor when ``backward_factors`` is None): calibration."""
        back = factors if backward_factors is None else backward_factors
        layers = tuple(
            replace(layer, forward_s=layer.forward_s * f, backward_s=layer.backward_s * g,
                    forward_iqr_s=layer.forward_iqr_s * f, backward_iqr_s=layer.backward_iqr_s * g,
                    backward_accumulate_s=None if layer.backward_accumulate_s is None
                    else layer.backward_accumulate_s * g)
            for layer, f, g in zip(self.layers, factors, back)
        )
        return Profile(layers, dict(self.meta))

    # -- JSON --------------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {"schema": PROFILE_SCHEMA, "meta": self.meta,
                "layers": [asdict(layer) for layer in self.layers]}

    @classmethod
    def from_json(cls, data: dict[str, Any], *, source: str = "profile") -> Profile:
        check_schema(data, PROFILE_SCHEMA, source)
        raw = data.get("layers")
        if not isinstance(raw, list):
            raise SchemaError(f"{source}: 'layers' must be a list of layer objects; regenerate the profile")
        known = {f.name for f in fields(LayerProfile)}
        required = ["name", "forward_s", "backward_s", "activation_bytes", "output_bytes", "param_bytes"]
        layers = []
        seen: dict[str, int] = {}
        for i, item in enumerate(raw):
            if not isinstance(item, dict):
                raise SchemaError(f"{source}: layer {i} is not an object; regenerate the profile")
            missing = [k for k in required if k not in item]
            if missing:
                raise SchemaError(f"{source}: layer {i} lacks {', '.join(missing)}; every layer needs "
                                  f"{', '.join(required)}")
            for k in required[1:]:
                v = item[k]
                if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
                    raise SchemaError(
                        f"{source}: layer {i} ({item['name']!r}) has {k} = {v!r}; costs must be finite "
                        "numbers >= 0; re-profile the model"
                    )
            opt = item.get("optimizer_s")
            if opt is not None and (not isinstance(opt, dict) or not all(
                    isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool)
                    and math.isfinite(v) and v >= 0 for k, v in opt.items())):
                raise SchemaError(f"{source}: layer {i} ({item['name']!r}) has optimizer_s = {opt!r}; it "
                                  "must map optimizer names to finite seconds >= 0, or be null; re-profile "
                                  "the model")
            if item.get("measured_as") is not None and not isinstance(item["measured_as"], str):
                raise SchemaError(f"{source}: layer {i} ({item['name']!r}) has measured_as = "
                                  f"{item['measured_as']!r}; "
                                  "it must be a layer name or null; re-profile the model")
            name = item["name"]
            twice = isinstance(name, str) and name in seen
            if not isinstance(name, str) or not name or twice:
                raise SchemaError(f"{source}: layer {i} has name {name!r}"
                                  f"{f', as layer {seen[name]} has' if twice else ''}; each layer needs its "
                                  "own non-empty name; re-profile the model")
            seen[name] = i
            for k in _OPTIONAL_COSTS:
                v = item.get(k)
                if (v is not None or k not in _NULLABLE) and k in item and not _cost(v):
                    raise SchemaError(f"{source}: layer {i} ({name!r}) has {k} = {v!r}; it must be a finite "
                                      f"number >= 0{' or null' if k in _NULLABLE else ''}; re-profile the "
                                      f"model")
            layers.append(LayerProfile(**{k: v for k, v in item.items() if k in known}))
        meta = data.get("meta") or {}
        if not isinstance(meta, dict):
            raise SchemaError(f"{source}: 'meta' must be an object")
        _check_meta(meta, source)
        _tied(meta.get("tied"), len(layers), source)
        return cls(tuple(layers), meta)

    def save(self, path: str | os.PathLike[str]) -> None:
        write_json_atomic(path, self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Profile:
        return cls.from_json(read_json(path, "profile"), source=f"profile {str(path)!r}")

    def digest(self) -> str:
        """sha256 (first 16 hex) of the canonical JSON of the layers' costs: identifies what a plan was made
        from. Where a row's figures came from (``measured_as``) is provenance, not cost, and is left out; the
        optimizer times are costs and count where measured, and are left out where absent (None), so that
        digests of profiles written before either existed stay the same. So are the tied parameters shared by
        two or more layers (their gradient sync is a cost): counted where there are any."""
        rows: list[Any] = [{k: v for k, v in asdict(layer).items()
                            if k != "measured_as" and not (k == "optimizer_s" and v is None)}
                           for layer in self.layers]
        ties = [[list(t.layers), t.bytes] for t in self.tied if len(t.layers) > 1]
        if ties:
            rows.append({"tied": ties})
        blob = json.dumps(rows, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


# what must agree between profiles of one model for their medians to mean anything
_SAME_CONDITIONS = ("model", "factory_options", "device", "dtype", "microbatch_size", "layers_arg",
                    "named_layers", "order")


def merge_profiles(profiles: Sequence[Profile]) -> Profile:
    """One profile from several profiles of the same model under the same conditions, each measured in its own
    process: per layer, the median over the profiles of every time (forward, backward, accumulating backward,
    their IQRs, each optimizer's step) and of the whole-model time; bytes from the first. A process's memory
    layout (addresses, hence cache conflicts) stays fixed for its life, so one process's figures share one
    offset (docs/accuracy.md: one GPT block's forward differed by up to 10% between fresh processes and by
    2.4% within one). The median over processes takes that offset out, as pyperf runs several
    processes for it.

    ``meta["load_average_1min"]`` is the highest any of them started under. ``meta["processes"]`` records the
    count, the source profiles' digests, and per layer the relative range ((max - min) / median) of its
    forward and backward over them. Raises :class:`SchemaError` when the profiles are of different models,
    layers or
    conditions.
    """
    profiles = list(profiles)
    if not profiles:
        raise SchemaError(
            "merge_profiles needs at least one profile; pass the profiles of one model to merge")
    first = profiles[0]
    for k, other in enumerate(profiles[1:], start=1):
        if other.names != first.names:
            raise SchemaError(f"profile {k} has layers {other.names} where profile 0 has {first.names}; "
                              "merge profiles of one model with the same layers")
        differ = [key for key in _SAME_CONDITIONS if other.meta.get(key) != first.meta.get(key)]
        if differ:
            key = differ[0]
            raise SchemaError(f"profile {k} has {key} = {other.meta.get(key)!r} where profile 0 has "
                              f"{first.meta.get(key)!r}; merge profiles taken under the same conditions")
    if len(profiles) == 1:
        return first

    def med(values: Sequence[float | None]) -> float | None:
        present = [float(v) for v in values if v is not None]
        return float(statistics.median(present)) if present and len(present) == len(values) else None

    layers, spread = [], []
    for i, base in enumerate(first.layers):
        rows = [p.layers[i] for p in profiles]
        opt: dict[str, float] | None = None
        if all(r.optimizer_s is not None for r in rows):
            keys = set.intersection(*(set(r.optimizer_s or {}) for r in rows))
            opt = {key: float(statistics.median((r.optimizer_s or {})[key] for r in rows))
                   for key in sorted(keys)}
        fwd = [r.forward_s for r in rows]
        bwd = [r.backward_s for r in rows]
        layers.append(replace(base, forward_s=float(statistics.median(fwd)),
                              backward_s=float(statistics.median(bwd)),
                              forward_iqr_s=float(statistics.median(r.forward_iqr_s for r in rows)),
                              backward_iqr_s=float(statistics.median(r.backward_iqr_s for r in rows)),
                              backward_accumulate_s=med([r.backward_accumulate_s for r in rows]),
                              optimizer_s=opt))
        spread.append({"layer": base.name, "forward": _range(fwd), "backward": _range(bwd)})
    meta = dict(first.meta)
    whole = med([p.meta.get("whole_model_s") for p in profiles])
    meta["whole_model_s"] = whole
    meta["sum_vs_whole"] = sum(layer.time_s for layer in layers) / whole if whole else None
    meta["load_average_1min"] = max(float(p.meta.get("load_average_1min", 0.0)) for p in profiles)
    rounds = [p.meta["timed_rounds"] for p in profiles if isinstance(p.meta.get("timed_rounds"), int)]
    if rounds:  # the fewest timed rounds a layer got in any of them
        meta["timed_rounds"] = min(rounds)
    floors = [(p.meta.get("optimizer_step") or {}).get("floor_s") for p in profiles]
    if all(isinstance(f, dict) for f in floors):
        # each optimizer step's fixed cost, as the layers' times: median
        keys = set.intersection(*(set(f) for f in floors))  # type: ignore[arg-type]
        floor_s = {k: float(statistics.median(f[k] for f in floors)) for k in sorted(keys)}  # type: ignore[index]
        meta["optimizer_step"] = {**(meta.get("optimizer_step") or {}), "floor_s": floor_s}
    meta["processes"] = {"count": len(profiles), "digests": [p.digest() for p in profiles], "range": spread,
                         "how": "per layer, the median of each time over profiles taken in separate "
                                "processes"}
    return Profile(tuple(layers), meta)


def _range(values: Sequence[float]) -> float:
    """(max - min) / median of positive values; 0.0 when the median is 0."""
    mid = statistics.median(values)
    return (max(values) - min(values)) / mid if mid > 0 else 0.0


def _tied(raw: Any, num_layers: int, source: str) -> tuple[TiedParameter, ...]:
    """``meta["tied"]`` checked: a list of {"names": [2+
    FQNs], "layers": [indices], "bytes": n}; None is none."""
    if raw is None:
        return ()
    rule = ("'tied' must be a list of {\"names\": [two or more FQNs], \"layers\": [sorted distinct layer "
            f"indices below {num_layers}], \"bytes\": integer >= 0}}")
    if not isinstance(raw, list):
        raise SchemaError(f"{source}: meta {rule}, got {type(raw).__name__}; re-profile the model")
    out = []
    for i, item in enumerate(raw):
        tie = _tied_entry(item, num_layers)
        if tie is None:
            raise SchemaError(f"{source}: meta {rule}; entry {i} is {item!r}; re-profile the model")
        out.append(tie)
    return tuple(out)


def _tied_entry(item: Any, num_layers: int) -> TiedParameter | None:
    """One entry of ``meta["tied"]``, or None when it breaks the rule."""
    if not isinstance(item, dict):
        return None
    names, layers, size = item.get("names"), item.get("layers"), item.get("bytes")
    if not (isinstance(names, list) and len(names) >= 2 and all(isinstance(n, str) for n in names)):
        return None
    if not (isinstance(layers, list) and all(type(k) is int and 0 <= k < num_layers for k in layers)
            and layers == sorted(set(layers))):
        return None
    if type(size) is not int or size < 0:
        return None
    return TiedParameter(tuple(names), tuple(layers), size)
