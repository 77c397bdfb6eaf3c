"""Layer signatures for dedup: class, attributes, parameter and input shapes and the export graph; layers with
equal signatures are measured once, and stage-order profiles pool them."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from stageplan.layers import (
    CutModel,
)
from stageplan.measure import Timer, median_iqr

# Above this relative difference between two instances of one layer, measuring it once is questionable.
DEDUP_SPREAD_WARN = 0.10

# The check of every member of a group of identical layers (see check_group). A member's figure in it is the
# least of its timed samples: other processes only ever add time, so the minimum is the run least disturbed
# ("the lowest value gives a lower bound for how fast your machine can run the given code snippet", Python's
# timeit documentation). A member whose figure falls outside [figure / k, figure * k] of the one whose
# figures it would reuse is measured on its own. k is the group's own spread made a margin: 1 + 3 x the
# largest relative IQR (IQR / median) of its members' samples, never below OFF_FLOOR and never above OFF_CAP.
# On a 2-core CPU host shared with other jobs, identical members read 0.90-1.18x (docs/profile-format.md),
# inside the 1.5x floor; the cap keeps a layer more than 3x off measured on its own however noisy the host
# (the layer_idx counterexample's heavy block reads 16-21x). A false alarm costs one layer's
# measurement, never a figure.
OFF_FLOOR = 1.5
OFF_CAP = 3.0
# the check times each member's forward at least CHECK_ROUNDS times, after one warm-up, and until its least
# sample times their count reaches CHECK_MIN_S: undisturbed work, so that samples a busy host stretched do not
# end the check early (a 20 us block's least then comes of 500 samples; a 1 s block's of three). A streamed
# member found off is checked once more before it is measured apart (the layer it is checked against was timed
# earlier, under the host's load then).
CHECK_ROUNDS = 3
CHECK_MIN_S = 0.01
CHECK_MAX_ROUNDS = 1000


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
class GroupCheck:
    """Every member of a group of identical layers against the one whose figures the others reuse, ``rep``:
    ``forward``, each member's figure in the check (the least of its forwards timed without grad) over
    ``rep``'s (1.0 for ``rep``); ``tolerance``, the k of [1/k, k] outside which a member is off."""

    rep: int
    members: tuple[int, ...]
    forward: tuple[float, ...]
    tolerance: float

    def off(self) -> list[int]:
        """The members outside [1/tolerance, tolerance] of ``rep``'s figure."""
        k = self.tolerance
        return [m for m, r in zip(self.members, self.forward) if not 1 / k <= r <= k]


@dataclass(frozen=True)
class Dedup:
    """``rep[k]``: the piece whose figures piece k reuses (itself when measured); ``spread``: the second and
    third instances of the largest group, both measured, or None when no group has three; ``groups``: the
    layers of each signature two or more share; ``checks``: every member of every group against the
    group's second (:func:`check_group`), None where nothing is timed (an estimate); ``apart``: the layers
    those checks found off the figures they would have reused, measured on their own."""

    rep: list[int]
    spread: tuple[int, int] | None
    distinct: int = 0  # distinct signatures
    # in model order; a group's second is its representative (its first follows another kind of layer)
    groups: tuple[tuple[int, ...], ...] = ()
    checks: tuple[GroupCheck, ...] | None = ()
    apart: tuple[int, ...] = ()

    @property
    def measured(self) -> list[int]:
        ks = {k for k, r in enumerate(self.rep) if r == k}
        if self.spread is not None:
            ks.add(self.spread[1])
        return sorted(ks)

    def checked(self, checks: Sequence[GroupCheck], judged: Collection[int],
                apart: Collection[int] | None = None) -> Dedup:
        """This plan after ``checks``: each of the ``judged`` layers (those that would take another's figures)
        found off them is its own representative, measured on its own; the checks are kept for the meta.
        ``apart``: the layers found off as the checks went (a layer-at-a-time profile judges each member when
        it holds it, against the members before it), instead of those the whole groups' checks find."""
        off = {k for c in checks for k in c.off() if k != c.rep} if apart is None else set(apart)
        off &= set(judged)
        rep = [k if k in off else r for k, r in enumerate(self.rep)]
        return dataclasses.replace(self, rep=rep, checks=tuple(checks), apart=tuple(sorted(off)))

    def reusers(self) -> set[int]:
        """The layers whose rows take another layer's figures."""
        return {k for k, r in enumerate(self.rep) if r != k}


def tolerance(samples: Sequence[Sequence[float]]) -> float:
    """The k of [figure / k, figure * k] for a group whose members' timings are ``samples``: 1 + 3 x the
    largest relative IQR among them, within [OFF_FLOOR, OFF_CAP].

    >>> tolerance([[1.0, 1.0, 1.0], [2.0, 2.0, 2.1]])
    1.5
    >>> tolerance([[1.0, 1.2, 1.4, 1.6, 1.8]])  # IQR 0.4 over a median of 1.4: a busy host
    1.8571428571428572
    """
    rel = [iqr / med for med, iqr in (median_iqr(s) for s in samples if s) if med > 0 and math.isfinite(iqr)]
    return min(OFF_CAP, max(OFF_FLOOR, 1 + 3 * max(rel, default=0.0)))


def check_group(rep: int, forward: Mapping[int, Sequence[float]]) -> GroupCheck:
    """Every member of a group (the keys of ``forward``, each with its timed samples) against ``rep``: the
    ratios of their least samples, and the tolerance from the group's own spread (:func:`tolerance`).

    >>> c = check_group(1, {0: [1.0] * 3, 1: [1.0, 1.0, 3.0], 2: [1.1] * 3, 3: [24.0] * 3})
    >>> c.forward, c.tolerance, c.off()
    ((1.0, 1.0, 1.1, 24.0), 3.0, [3])
    """
    members = tuple(sorted(forward))
    base = min(forward[rep])
    return GroupCheck(rep, members, tuple(min(forward[m]) / base if base > 0 else 1.0 for m in members),
                      tolerance(list(forward.values())))


def forward_checks(timer: Timer, forwards: Mapping[int, Callable[[], Any]], *,
                   rounds: int = CHECK_ROUNDS, warmup: int = 1,
                   min_time_s: float = CHECK_MIN_S) -> dict[int, list[float]]:
    """Each layer's own forward, without grad: ``warmup`` untimed, then timed in rounds over all of
    ``forwards`` (a change in the machine's speed hits them alike), at least ``rounds`` and until each one's
    least sample times its count reaches ``min_time_s`` (at most CHECK_MAX_ROUNDS): the check of a group's
    members."""
    out: dict[int, list[float]] = {k: [] for k in forwards}
    if not out:
        return out
    with torch.no_grad():
        rnd = 0
        while rnd < warmup + rounds or (rnd < warmup + CHECK_MAX_ROUNDS
                                        and min(min(v) * len(v) for v in out.values()) < min_time_s):
            for k, fwd in forwards.items():
                t, res = timer(fwd)
                del res
                if rnd >= warmup:
                    out[k].append(t)
            rnd += 1
    return out


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
    shared = tuple(tuple(g) for g in groups.values() if len(g) > 1)
    return Dedup(rep, spread, len(groups), shared)


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
