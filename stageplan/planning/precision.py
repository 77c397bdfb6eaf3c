"""A profile priced at the training precision (``plan --precision``): activation and boundary bytes at the
precision's element size, the optimizer step at the bytes it moves, or a refusal where scaling would be wrong
(no torch)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from stageplan.errors import StageplanError
from stageplan.formats.profile import LayerProfile, Profile
from stageplan.planning.costs import OPTIMIZER_STATE_FACTOR, PRECISIONS

# Bytes per element of the dtypes a profile's meta["dtype"] names (torch's element sizes).
DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}


@dataclass(frozen=True)
class AtPrecision:
    """The profile to price (the given one where nothing changes) and the one-line plan note that says what
    changed (None: nothing did)."""

    profile: Profile
    note: str | None


def step_bytes_per_parameter(precision: str | None, optimizer: str, element_bytes: int = 4) -> float:
    """Bytes one optimizer step reads and writes per parameter: memory-bound, each tensor once.

    - Without a master copy (fp32, bf16, or ``precision`` None at ``element_bytes``): read the weight and its
      gradient, write the weight, read and write each state: (3 + 2 x states) x element bytes, torch's
      single-tensor ``step`` (``OPTIMIZER_PASSES`` in profiling/optimizer.py: sgd 3, momentum 5, adam 7).
    - With an fp32 master copy (bf16-mixed, fp16-mixed; Micikevicius et al. 2018, "Mixed Precision Training",
      section 3.1): read the 16-bit gradient, read and write the fp32 master and each fp32 state, write the
      16-bit weight: Adam 2 + 8 + 2 x 8 + 2 = 28 bytes, twice the 14 of a bf16 step.

    >>> step_bytes_per_parameter("bf16-mixed", "adam"), step_bytes_per_parameter(None, "adam", 2)
    (28.0, 14.0)
    """
    states = OPTIMIZER_STATE_FACTOR[optimizer]
    if precision is None:
        weight = grad = state = float(element_bytes)
        master = 0.0
    else:
        weight, grad, master, state = PRECISIONS[precision]
    weights = weight + 2.0 * master if master else 2.0 * weight
    return grad + weights + 2.0 * states * state


def at_precision(profile: Profile, precision: str | None, optimizer: str = "adam") -> AtPrecision:
    """``profile`` with its bytes at ``precision``'s: the one place ``plan`` applies ``--precision`` to the
    per-layer figures (``PRECISIONS`` in costs.py gives the bytes per parameter it holds).

    - Activation and boundary bytes (``activation_bytes``, ``output_bytes``) of a measured profile are scaled
      by the precision's element size over the profiled dtype's (fp32 to a 16-bit precision: x 0.5; a 16-bit
      profile planned as fp32: x 2). Under mixed precision some saved tensors stay fp32 (HF's RMSNorm upcasts,
      SDPA's logsumexp), so the scaled figure undercounts them; the note says so, and profiling in the 16-bit
      dtype measures them.
    - An estimate (``--device estimate:GPU``) whose dtype does not match is refused: it is cheap to redo in
      the right dtype on fake tensors, which counts those fp32 tensors exactly, where scaling would not.
    - The optimizer step (``optimizer_s`` of every optimizer) is scaled by :func:`step_bytes_per_parameter` at
      ``precision`` over the same at the profiled dtype without a master copy, above the step's fixed cost
      (``meta.optimizer_step.floor_s``), which no byte count moves.

    Times are left as profiled. Unknown precisions are left to the cost options to refuse.

    >>> from stageplan import LayerProfile, Profile
    >>> prof = Profile((LayerProfile("a", 1.0, 2.0, 400, 40, 8),),
    ...                {"dtype": "float32", "timer": "perf_counter"})
    >>> priced = at_precision(prof, "bf16-mixed")
    >>> priced.profile.layers[0].activation_bytes, priced.profile.layers[0].output_bytes
    (200, 20)
    """
    if precision is None or precision not in PRECISIONS:
        return AtPrecision(profile, None)
    dtype = str(profile.meta.get("dtype"))
    source = DTYPE_BYTES.get(dtype)
    if source is None:
        return AtPrecision(profile, f"precision {precision}: the profile names no dtype it was profiled in "
                                    f"({profile.meta.get('dtype')!r}), so its activation, boundary and "
                                    "optimizer-step bytes are priced as profiled")
    target = int(PRECISIONS[precision][0])
    estimate = profile.meta.get("timer") == "analytic"
    if estimate and source != target:
        raise StageplanError(
            f"precision {precision} computes in {target}-byte elements, but this estimate was made in "
            f"{dtype} ({source} bytes); scaling its saved bytes would miss the tensors that stay fp32 in a "
            f"16-bit model (HF's RMSNorm upcasts); re-estimate with --dtype "
            f"{'float32' if target == 4 else 'bfloat16'}, or plan without --precision")
    bytes_factor = target / source
    step_factors = {name: step_bytes_per_parameter(precision, name)
                    / step_bytes_per_parameter(None, name, source)
                    for name in OPTIMIZER_STATE_FACTOR if name != "none"}
    floors = (profile.meta.get("optimizer_step") or {}).get("floor_s") or {}
    if bytes_factor == 1 and all(f == 1 for f in step_factors.values()):
        return AtPrecision(profile, None)
    layers = tuple(_scaled(x, bytes_factor, step_factors, floors) for x in profile.layers)
    said: list[str] = []
    if bytes_factor != 1:
        said.append(f"activation and boundary bytes scaled x{bytes_factor:g} from the profiled {dtype} "
                    f"(tensors kept in fp32 are {'under' if bytes_factor < 1 else 'over'}counted; profile in "
                    f"{'bfloat16' if target == 2 else 'float32'} to measure them)")
    if optimizer in step_factors and step_factors[optimizer] != 1:
        said.append(f"{optimizer} step at {step_bytes_per_parameter(precision, optimizer):g} bytes per "
                    f"parameter (x{step_factors[optimizer]:g})")
    note = f"precision {precision}: " + "; ".join(said) if said else None
    return AtPrecision(Profile(layers, dict(profile.meta)), note)


def _scaled(layer: LayerProfile, bytes_factor: float, step_factors: dict[str, float],
            floors: dict[str, Any]) -> LayerProfile:
    optimizer_s = layer.optimizer_s
    if optimizer_s is not None:
        optimizer_s = {}
        for name, t in layer.optimizer_s.items():  # type: ignore[union-attr]
            floor = floors.get(name)
            floor = float(floor) if isinstance(floor, (int, float)) and math.isfinite(floor) else 0.0
            above = max(t - floor, 0.0) if t > 0 else 0.0
            optimizer_s[name] = t if t <= 0 else min(t, floor) + above * step_factors.get(name, 1.0)
    return replace(layer, activation_bytes=round(layer.activation_bytes * bytes_factor),
                   output_bytes=round(layer.output_bytes * bytes_factor), optimizer_s=optimizer_s)
