"""Workload: a model, one full batch of inputs, an optional target and loss (what gets profiled and run)."""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from stageplan.errors import WorkloadError


def default_microbatch_size(batch_size: int) -> int:
    """Default microbatch: a quarter of the batch when it divides, else 1 (so m = 4 microbatches)."""
    return batch_size // 4 if batch_size % 4 == 0 and batch_size >= 4 else 1


@dataclass
class Workload:
    """A model with one full batch of example inputs.

    ``inputs`` is a tensor or a tuple of tensors holding one full batch; microbatches are slices
    along dim 0. ``loss_fn(output, target)`` returns a scalar. Without a ``loss_fn`` the loss is
    ``output.float().pow(2).mean()`` (enough to drive a backward pass through every layer).
    ``factory_options`` records how a factory built it (saved in profile metadata).

    For a model bigger than the machine, pass ``model=None`` and ``model_fn``, a function that builds the
    ``nn.Module``: stageplan calls it with parameters on meta and materialises only a layer (to profile it) or
    a
    rank's stage (to run it). The inputs stay small and real.
    """

    model: Any
    inputs: Any
    target: Any = None
    loss_fn: Callable[[Any, Any], Any] | None = None
    name: str = ""
    factory_options: dict[str, Any] = field(default_factory=dict)
    model_fn: Callable[[], Any] | None = None

    def __post_init__(self) -> None:
        if self.model is None and self.model_fn is None:
            raise WorkloadError("a Workload needs a model, or model_fn (a function building it) for a model "
                                "too big to build here; pass Workload(model, inputs) or Workload(None, "
                                "inputs, model_fn=build)")

    def input_tuple(self) -> tuple[Any, ...]:
        return tuple(self.inputs) if isinstance(self.inputs, (tuple, list)) else (self.inputs,)

    @property
    def batch_size(self) -> int:
        first = self.input_tuple()[0]
        shape = getattr(first, "shape", None)
        if not shape:
            raise WorkloadError(
                f"workload {self.name!r}: inputs must be tensors with a batch dimension (dim 0); "
                f"got {type(first).__name__}; pass a tensor or a tuple of tensors"
            )
        return int(shape[0])

    def compute_loss(self, output: Any, target: Any) -> Any:
        if self.loss_fn is not None:
            return self.loss_fn(output, target)
        if isinstance(output, (tuple, list)):
            output = output[0]
        return output.float().pow(2).mean()


def import_factory_module(name: str) -> ModuleType:
    """Import the module of a ``module:factory`` spec as ``python -m`` finds modules: from the current folder
    first. The ``stageplan`` console script starts with its own bin folder as ``sys.path[0]`` (not the
    current folder, as ``python -m`` and ``python script.py`` do), so a ``mymodel.py`` beside the user was not
    found without ``PYTHONPATH=.``. The folder stays on ``sys.path``: the rank processes a run spawns get
    ``sys.path`` as their PYTHONPATH and import the same module."""
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    return importlib.import_module(name)


def check_model_name(name: str, planned: object, what: str = "plan") -> None:
    """Refuse a plan (or profile: ``what``) made for another model before any check of its shapes: a gpt plan
    run with the convnet failed first on its microbatch size, and that error's remedy (re-profile at another
    microbatch size) sent the user the wrong way. Names compare by their last part, so ``pkg.mod:build`` and
    ``build`` match; an unnamed workload (the API's ``Workload(model, inputs)``) is not checked."""
    if not isinstance(planned, str) or not planned or not name:
        return
    if planned.rsplit(":", 1)[-1] != name.rsplit(":", 1)[-1]:
        raise WorkloadError(f"{what} made for {planned!r}, and this run builds {name!r}: its layers and "
                            f"times describe another model; run {planned!r} with this {what}, or profile "
                            f"and plan {name!r}")


# Whether the command running is the CLI's: a remedy then names the CLI's flag (--set), and from Python the
# API's keyword (factory_options=), so each reader is told what they can type. stageplan.cli.main sets it.
IN_CLI: ContextVar[bool] = ContextVar("stageplan_in_cli", default=False)


def options_words(*assignments: str) -> str:
    """How the reader passes factory options ``key=value``: ``--set key=value`` under the CLI, else
    ``factory_options={'key': value}``.

    >>> options_words("tied=true", "n_layer=4")
    "factory_options={'tied': True, 'n_layer': 4}"
    """
    if IN_CLI.get():
        return " ".join(f"--set {a}" for a in assignments)
    pairs = []
    for a in assignments:
        key, _, raw = a.partition("=")
        low = raw.lower()
        value: Any = low == "true" if low in ("true", "false") else raw
        for cast in (int, float):
            if isinstance(value, str):
                with contextlib.suppress(ValueError):
                    value = cast(raw)
        pairs.append(f"{key!r}: {value!r}")
    return "factory_options={" + ", ".join(pairs) + "}"
