"""Layer signatures for dedup: class, attributes, parameter and input shapes and the export graph; layers with
equal signatures are measured once, and stage-order profiles pool them."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from stageplan.layers import (
    CutModel,
)

# Above this relative difference between two instances of one layer, measuring it once is questionable.
DEDUP_SPREAD_WARN = 0.10


# --------------------------------------------------------------------------------------------------
# Signatures: which layers are identical, so that each is measured once

# Attributes that number a layer within its model (HF's layer_idx, Megatron's layer_number) differ between
# otherwise identical layers and change nothing in what they compute.
_INDEX_ATTR = re.compile(r"(?:.*_)?(?:layer|block|stage)_?(?:idx|index|id|number|num)|idx|index")
_PRIMITIVE = (bool, int, float, str, type(None), torch.dtype, torch.device)


def _const(value: Any, nodes: dict[Any, int] | None = None) -> Any:
    """A hashable, address-free stand-in for a graph argument or a module attribute (None: leave it out). A
    graph node stands in as its position in its graph (``nodes``), so that the wiring counts, not only the
    ops."""
    if isinstance(value, torch.fx.Node):
        return f"%{nodes[value]}" if nodes is not None and value in nodes else "%"
    if isinstance(value, _PRIMITIVE):
        return value if isinstance(value, (bool, int, float, str, type(None))) else str(value)
    if isinstance(value, (tuple, list)):
        items = tuple(_const(v, nodes) for v in value)
        return None if any(i is None and v is not None for i, v in zip(items, value)) else items
    if isinstance(value, slice):
        return ("slice", _const(value.start, nodes), _const(value.stop, nodes), _const(value.step, nodes))
    if isinstance(value, dict):
        return tuple(sorted((str(k), repr(_const(v, nodes))) for k, v in value.items()))
    return None


def _attribute(value: Any) -> Any:
    """A module attribute in a signature: its constant; a named function by its qualified name; any other
    object (a lambda, a tensor that is not a buffer, a config) by its identity, so that two layers holding
    different ones are measured apart (torch.relu against a lambda, or two config objects, had been taken as
    one layer)."""
    c = _const(value)
    if c is not None or value is None:
        return c
    name = getattr(value, "__qualname__", None)
    if callable(value) and isinstance(name, str) and "<" not in name and getattr(value, "__module__", None):
        return ("function", f"{value.__module__}.{name}")
    return ("object", type(value).__qualname__, id(value))


def _graph_signature(graph: torch.fx.Graph, rename: Callable[[str], str]) -> tuple[Any, ...]:
    out: list[Any] = []
    nodes = {node: k for k, node in enumerate(graph.nodes)}
    for node in graph.nodes:
        if node.op == "placeholder":  # its name is the producer's, which differs from layer to layer
            out.append(("placeholder",))
            continue
        target = (
            rename(node.target) if isinstance(node.target, str) and node.op != "output" else str(node.target)
        )
        out.append((node.op, target, _const(node.args, nodes), _const(dict(node.kwargs), nodes)))
    return tuple(out)


def _module_signature(module: nn.Module, layer: str) -> tuple[Any, ...]:
    """Class, structure (child types and extra_repr), non-index attributes, graphs of exported code, and the
    names (relative to ``layer``), shapes and dtypes of the parameters and buffers."""

    def rename(name: str) -> str:
        if layer and (name == layer or name.startswith(layer + ".")):
            return "<layer>" + name[len(layer):]
        return name

    def rename_in(owner: str) -> Callable[[str], str]:
        return lambda target: rename(f"{owner}.{target}" if owner else target)

    mods: list[tuple[Any, ...]] = []
    for name, mod in module.named_modules():
        graph = getattr(mod, "graph", None)
        if isinstance(graph, torch.fx.Graph):  # exported code: its graph is its structure
            mods.append((rename(name), "graph", _graph_signature(graph, rename_in(name))))
            continue
        attrs = tuple(sorted(((k, _attribute(v)) for k, v in vars(mod).items()
                              if not k.startswith("_") and not _INDEX_ATTR.fullmatch(k)),
                             key=lambda kv: kv[0]))
        mods.append(
            (rename(name), f"{type(mod).__module__}.{type(mod).__qualname__}", mod.extra_repr(), attrs))
    params = tuple((rename(n), tuple(p.shape), str(p.dtype), p.requires_grad)
                   for n, p in module.named_parameters(remove_duplicate=False))
    buffers = tuple((rename(n), tuple(b.shape), str(b.dtype)) for n,
                    b in module.named_buffers(remove_duplicate=False))
    return (tuple(mods), params, buffers)


def _input_spec(value: Any, requires_grad: bool) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), str(value.dtype), requires_grad and value.is_floating_point())
    return ("value", _const(value) if _const(value) is not None else type(value).__qualname__)


def layer_signature(cut: CutModel, k: int, model: nn.Module, inputs: Sequence[Any]) -> tuple[Any, ...]:
    """What makes piece ``k`` cost what it costs: its own code and parameters, the original module it stands
    for (named layers), the shapes and dtypes of its inputs, whether they need a gradient (every piece after
    the first), and whether it computes the loss (the last)."""
    piece = cut.pieces[k]
    sig: list[Any] = [k == len(cut.pieces) - 1, tuple(_input_spec(v, k > 0) for v in inputs)]
    if cut.method == "sequential":
        sig.append(_module_signature(piece.module, ""))
    else:
        sig.append(_module_signature(piece.module, piece.name))
        if piece.name in cut.named:
            sig.append(_module_signature(model.get_submodule(piece.name), ""))
    return tuple(sig)


@dataclass(frozen=True)
class Dedup:
    """``rep[k]``: the piece whose figures piece k reuses (itself when measured); ``spread``: the second and
    third instances of the largest group, both measured, or None when no group has three."""

    rep: list[int]
    spread: tuple[int, int] | None
    distinct: int = 0  # distinct signatures

    @property
    def measured(self) -> list[int]:
        ks = {k for k, r in enumerate(self.rep) if r == k}
        if self.spread is not None:
            ks.add(self.spread[1])
        return sorted(ks)


def plan_dedup(signatures: Sequence[Any], enabled: bool) -> Dedup:
    n = len(signatures)
    if not enabled:
        return Dedup(list(range(n)), None, n)
    groups: dict[Any, list[int]] = {}
    for k, sig in enumerate(signatures):
        groups.setdefault(sig, []).append(k)
    # The first of a run of identical layers follows a different layer (the embedding, whose backward writes a
    # multi-MiB gradient), the others follow their own kind: GPT's blocks.0 measured 1.27x blocks.1-5, alone
    # and inside the pipeline (measured on a 2-core CPU host). So the first and the second instance are
    # measured, and the rest reuse the second.
    rep = list(range(n))
    for members in groups.values():
        for k in members[2:]:
            rep[k] = members[1]
    # the spread check compares two instances that should
    # agree: the second and third (both follow their own kind)
    largest = max(groups.values(), key=len)  # the first of the largest groups on a tie (dicts keep order)
    spread = (largest[1], largest[2]) if len(largest) > 2 else None  # of a pair, both are measured and used
    return Dedup(rep, spread, len(groups))


def stage_pools(signatures: Sequence[Any]) -> list[list[int]]:
    """Groups of two or more identical layers between identical neighbours (the same signature before and
    after, or none): in a stage's order each is timed in its place, and what can differ between them is the
    neighbours (the first block follows the embedding, the last precedes the head), so each such group's
    figures are the medians over all its members' rounds: more samples, and no boundary moved by one block
    reading slower than its twin."""
    n = len(signatures)
    groups: dict[Any, list[int]] = {}
    for k in range(n):
        key = (signatures[k - 1] if k > 0 else None, signatures[k], signatures[k + 1] if k < n - 1 else None)
        groups.setdefault(key, []).append(k)
    return [g for g in groups.values() if len(g) > 1]
