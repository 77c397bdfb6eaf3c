"""Find a model's layers and cut it into runnable pieces: per layer (profiling) or per stage (execution).

Two cutting paths, one interface:
- ``nn.Sequential``: each child is a layer; a piece is a slice of the children.
- any other model: named modules (FQNs or glob patterns; by default the children of the largest
  ``nn.ModuleList``, or failing that of the largest child ``nn.Sequential``) become layers, the code before
  the first and after the last one become layers of their own, and torch.export-based splitting
  (``torch.distributed.pipelining``) hands each piece
  exactly the tensors that cross its boundary (skip connections included).
"""

from __future__ import annotations

import contextlib
import copy
import fnmatch
import io
import logging
import types
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from stageplan.errors import WorkloadError

# A reference to a value in the chain: ("arg", i) is the i-th model input; ("out", k, j) is output j of
# piece k (j is None when the piece returns a single tensor).
Ref = tuple[Any, ...]


@dataclass
class Piece:
    """One runnable piece of a cut model (a layer, or a stage made of consecutive layers)."""

    name: str
    module: nn.Module
    inputs: list[Ref]


@dataclass
class CutModel:
    """A model cut into consecutive pieces, with the data flow between them."""

    pieces: list[Piece]
    outputs: list[Ref]  # what the whole model returns (the last piece's output in practice)
    method: str  # "sequential" or "export"
    named: list[str] = field(default_factory=list)  # layers that are modules (not the code around them)

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.pieces]

    def run(self, args: Sequence[Any]) -> Any:
        """Run the pieces in order (used to check cut-and-chain equals the whole model)."""
        env: dict[Ref, Any] = {}
        for k, piece in enumerate(self.pieces):
            out = piece.module(*[resolve(r, args, env) for r in piece.inputs])
            store_outputs(env, k, out)
        outs = [resolve(r, args, env) for r in self.outputs]
        return outs[0] if len(outs) == 1 else tuple(outs)

    def crossing_refs(self, after: int) -> list[Ref]:
        """Values produced at or before piece ``after`` (or model inputs) and consumed after it."""
        needed: list[Ref] = []
        for piece in self.pieces[after + 1 :]:
            for r in piece.inputs:
                produced_before = r[0] == "arg" or r[1] <= after
                if produced_before and r not in needed:
                    needed.append(r)
        return needed


def resolve(ref: Ref, args: Sequence[Any], env: dict[Ref, Any]) -> Any:
    if ref[0] == "arg":
        return args[ref[1]]
    return env[ref]


def store_outputs(env: dict[Ref, Any], k: int, out: Any) -> None:
    if isinstance(out, (tuple, list)):
        for j, o in enumerate(out):
            env[("out", k, j)] = o
    else:
        env[("out", k, None)] = out


def _largest_container(model: nn.Module, kind: type[nn.ModuleList] | type[nn.Sequential]) -> list[str]:
    """FQNs of the children of the submodule of type ``kind`` with the most children; the first in model order
    on a tie. A Sequential inside another one is a part of a block (its MLP, or the block itself), not a trunk
    of blocks, so only the outermost Sequentials count. (A model that is itself a container is not one of its
    submodules: an nn.Sequential model is handled before, and an nn.ModuleList has no forward.)"""
    best: list[str] = []
    outer: list[str] = []  # Sequentials seen so far; named_modules walks parents before their children
    for name, mod in model.named_modules():
        if not name or not isinstance(mod, kind) or any(name.startswith(o + ".") for o in outer):
            continue
        if isinstance(mod, nn.Sequential):
            outer.append(name)
        if len(mod) > len(best):
            best = [f"{name}.{child}" for child, _ in mod.named_children()]
    return best


def resolve_layer_names(model: nn.Module, layers: Sequence[str] | None) -> list[str]:
    """Expand FQNs/glob patterns to module FQNs in model order.

    Default, first rule that finds any: the children of the model if it is an nn.Sequential; else the children
    of its largest nn.ModuleList; else the children of its largest child nn.Sequential (``self.layers =
    nn.Sequential(...)``), counting only Sequentials that are not inside another Sequential. Code around the
    container (embeddings, a head, a skip connection) runs in pieces of its own (see :func:`cut_layers`).
    """
    if isinstance(model, nn.Sequential) and not layers:
        return [name for name, _ in model.named_children()]
    if not layers:
        names = _largest_container(model, nn.ModuleList) or _largest_container(model, nn.Sequential)
        if not names:
            raise WorkloadError(
                f"cannot find layers in {type(model).__name__}: it is not an nn.Sequential and has no "
                "nn.ModuleList and no child nn.Sequential; name the layers explicitly, e.g. --layers "
                "'encoder.blocks.*'"
            )
        return names
    all_names = [name for name, _ in model.named_modules() if name]
    chosen: list[str] = []
    for pattern in layers:
        hits = [n for n in all_names if fnmatch.fnmatchcase(n, pattern)
                and n.count(".") == pattern.count(".")]
        if not hits:
            sample = ", ".join(n for n in all_names if n.count(".") <= 1)[:300]
            raise WorkloadError(
                f"layer pattern {pattern!r} matches no module of {type(model).__name__}; "
                f"top-level modules are: {sample}; use module FQNs or glob patterns such as 'transformer.h.*'"
            )
        chosen.extend(h for h in hits if h not in chosen)
    order = {n: i for i, n in enumerate(all_names)}
    chosen.sort(key=lambda n: order[n])
    for a in chosen:
        for b in chosen:
            if a != b and b.startswith(a + "."):
                raise WorkloadError(
                    f"layer {b!r} is inside layer {a!r}; layers must not nest; pick one level, e.g. only "
                    f"{a!r}'s children"
                )
    return chosen


def _used_parameters(module: nn.Module) -> dict[str, nn.Parameter]:
    """Parameters a piece actually uses. Exported pieces can carry unused leftovers of tied weights."""
    graph = getattr(module, "graph", None)
    if graph is None:
        return dict(module.named_parameters())
    used: dict[str, nn.Parameter] = {}
    for node in graph.nodes:
        if node.op == "call_module":
            sub = module.get_submodule(node.target)
            for n, p in _used_parameters(sub).items():
                used[f"{node.target}.{n}"] = p
        elif node.op == "get_attr":
            obj: Any = module
            for atom in str(node.target).split("."):
                obj = getattr(obj, atom)
            if isinstance(obj, nn.Parameter):
                used[str(node.target)] = obj
    return used


def used_parameters(module: nn.Module) -> dict[str, nn.Parameter]:
    """Parameters (by FQN of the original model) that a piece uses."""
    return _used_parameters(module)


def _mark_splits(model: nn.Module, boundaries_before: Sequence[str], split_after: str | None) -> None:
    """Insert pipe_split() before each named module and after ``split_after`` (out of torch's annotate,
    which cannot split both before and after one module)."""
    from torch.distributed.pipelining import pipe_split

    def wrap(name: str, before: bool, after: bool) -> None:
        mod = model.get_submodule(name)
        orig = mod.forward

        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            if before:
                pipe_split()
            out = orig(*args, **kwargs)
            if after:
                pipe_split()
            return out

        mod.forward = types.MethodType(forward, mod)

    names = list(dict.fromkeys([*boundaries_before, *([split_after] if split_after else [])]))
    for name in names:
        wrap(name, name in boundaries_before, name == split_after)


def _first_sentence(text: str, limit: int = 160) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    cut = line.find(". ")
    line = line[: cut + 1] if 0 < cut < limit else line
    return line if len(line) <= limit else line[:limit].rsplit(" ", 1)[0] + "..."


def _export_split(model: nn.Module, example_args: tuple[Any, ...], split_before: Sequence[str],
                  split_after: str | None) -> Any:
    from torch.distributed.pipelining._IR import Pipe

    work = copy.deepcopy(model)
    _mark_splits(work, split_before, split_after)

    def trace(args: tuple[Any, ...]) -> Any:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.export's own deprecation chatter
            logging.disable(logging.CRITICAL)  # and its multi-page graph dumps on failure
            try:
                with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
                    return Pipe.from_tracing(work, args, {})
            finally:
                logging.disable(logging.NOTSET)

    try:
        try:
            pipe = trace(example_args)
        except Exception:
            # A model whose parameters are on meta (built without memory) traces with real inputs as long as
            # its first op makes meta tensors (an embedding); a first op mixing a real input with a meta
            # weight (a Linear) needs meta inputs, and some models need real ones (pytorch #156541): try both.
            if not any(p.device.type == "meta" for p in model.parameters()):
                raise
            pipe = trace(tuple(a.to("meta") if isinstance(a, torch.Tensor) else a for a in example_args))
    except Exception as exc:
        reason = _first_sentence(str(exc)) or type(exc).__name__
        raise WorkloadError(
            f"torch.export cannot split {type(model).__name__} ({type(exc).__name__}: {reason}); "
            "name layers explicitly with --layers (modules whose forward exports cleanly), or wrap the model "
            "in an nn.Sequential"
        ) from exc
    # Unflattened pieces run through torch.fx.Interpreter by default (about 40% slower than eager on a small
    # transformer block, measured on a 2-core CPU host); the generated code path runs the same graph at eager
    # speed.
    for mod in pipe.split_gm.modules():
        if hasattr(mod, "_run_with_interpreter"):
            mod._run_with_interpreter = False
    return pipe


def _pieces_from_pipe(pipe: Any, names: list[str]) -> CutModel:
    graph = pipe.split_gm.graph
    placeholders: dict[str, int] = {}
    producer: dict[str, Ref] = {}
    pieces: list[Piece] = []
    outputs: list[Ref] = []
    for node in graph.nodes:
        if node.op == "placeholder":
            placeholders[node.name] = len(placeholders)
            producer[node.name] = ("arg", placeholders[node.name])
        elif node.op == "call_module":
            k = len(pieces)
            refs = [producer[a.name] for a in node.args]
            pieces.append(Piece(names[k] if k < len(names) else f"piece{k}",
                                pipe.split_gm.get_submodule(node.target), refs))
            producer[node.name] = ("out", k, None)
        elif node.op == "call_function":  # operator.getitem on a piece's tuple output
            src, idx = node.args
            ref = producer[src.name]
            producer[node.name] = ("out", ref[1], idx)
        elif node.op == "output":
            outs = node.args[0]
            outs = outs if isinstance(outs, (tuple, list)) else (outs,)
            outputs = [producer[o.name] for o in outs]
    # A piece whose output is consumed through getitem returns a tuple; fix single-output refs.
    tuple_producers = {r[1] for p in pieces for r in p.inputs if r[0] == "out" and r[2] is not None}
    tuple_producers |= {r[1] for r in outputs if r[0] == "out" and r[2] is not None}
    for p in pieces:
        p.inputs = [("out", r[1], 0) if r[0] == "out" and r[2] is None and r[1] in tuple_producers else r
                    for r in p.inputs]
    return CutModel(pieces, outputs, "export")


def _group_names(module: nn.Module, fallback: str, depth: int) -> str:
    """Name a piece of code around the named layers by the modules it uses, in execution order, cut to the
    named layers' depth (e.g. 'tok_emb+pos_emb', 'ln_f+head', 'tok_emb+pos_emb+blocks.0')."""
    mods = list(dict.fromkeys(".".join(n.split(".")[:-1][:depth]) for n in used_parameters(module)))
    tops: list[str] = []
    for m in mods:  # collapse to the shortest distinct prefixes
        if not any(m == t or m.startswith(t + ".") for t in tops):
            tops = [t for t in tops if not t.startswith(m + ".")] + [m]
    return "+".join(tops) if tops else fallback


def cut_layers(
    model: nn.Module, example_args: tuple[Any, ...], layers: Sequence[str] | None = None
) -> CutModel:
    """Cut ``model`` into its layers. ``example_args`` are microbatch-sized inputs (used for export)."""
    if isinstance(model, nn.Sequential) and not layers:
        children = list(model.named_children())
        pieces = [Piece(name, mod,
                        [("arg", i) for i in range(len(example_args))] if k == 0 else [("out", k - 1, None)])
                  for k, (name, mod) in enumerate(children)]
        return CutModel(pieces, [("out", len(pieces) - 1, None)], "sequential",
                        [name for name, _ in children])
    names = resolve_layer_names(model, layers)
    pipe = _export_split(model, example_args, names, names[-1])
    n = pipe.num_stages
    cut = _pieces_from_pipe(pipe, [])
    if n == len(names) + 2:
        labels = ["", *names, ""]
    elif n == len(names) + 1:
        # Either nothing runs before the first named module or nothing after the last one. The pieces keep the
        # model's module FQNs, parameter-free ones too (a leading ReLU, Flatten or Dropout has no parameters).
        first = cut.pieces[0].module
        first_mods = {n for n, _ in first.named_modules()} | {k.rsplit(".", 1)[0]
                                                              for k in used_parameters(first)}
        starts_with_first = any(m == names[0] or m.startswith(names[0] + ".") for m in first_mods)
        labels = [*names, ""] if starts_with_first else ["", *names]
    elif n == len(names):
        labels = list(names)
    else:
        raise WorkloadError(
            f"splitting {type(model).__name__} at {len(names)} named layers gave {n} pieces, not "
            f"{len(names)} to {len(names) + 2}; a named module may run more than once or not at all; name "
            f"modules that each run once, in order"
        )
    for i, piece in enumerate(cut.pieces):
        if not labels[i]:
            labels[i] = _group_names(piece.module, "pre" if i == 0 else "post", names[0].count(".") + 1)
            while labels[i] in labels[:i] + labels[i + 1 :]:
                labels[i] += "_"
        piece.name = labels[i]
    cut.named = list(names)
    return cut


def cut_stages(model: nn.Module, example_args: tuple[Any, ...], layer_names: Sequence[str],
               boundaries: Sequence[int], layers: Sequence[str] | None = None) -> CutModel:
    """Cut ``model`` into stages at ``boundaries`` over its layers (named ``layer_names``), by the same
    rules as :func:`cut_layers`: slices for Sequential, export splitting at the stage-start layers
    otherwise."""
    bounds = list(boundaries)
    if isinstance(model, nn.Sequential) and not layers:
        from collections import OrderedDict

        children = list(model.named_children())
        pieces = []
        for s in range(len(bounds) - 1):
            # keep the children's names, so parameter FQNs match the uncut model's
            mod = nn.Sequential(OrderedDict(children[bounds[s] : bounds[s + 1]]))
            refs = [("arg", i) for i in range(len(example_args))] if s == 0 else [("out", s - 1, None)]
            pieces.append(Piece(f"stage{s}", mod, refs))
        return CutModel(pieces, [("out", len(pieces) - 1, None)], "sequential")
    names = resolve_layer_names(model, layers)
    layer_cut_names = list(layer_names)
    # Map each stage-start layer to the module FQN that begins it; "pre"/"post" layers are not modules.
    split_before: list[str] = []
    split_after: str | None = None
    for s in range(1, len(bounds) - 1):
        start = layer_cut_names[bounds[s]]
        if start in names:
            split_before.append(start)
        else:  # the stage starts at the code after the last named module
            split_after = names[-1]
    pipe = _export_split(model, example_args, split_before, split_after)
    if pipe.num_stages != len(bounds) - 1:
        raise WorkloadError(
            f"cutting at the plan's boundaries gave {pipe.num_stages} stages, expected {len(bounds) - 1}; "
            "the plan was probably made for a different layer split; re-profile and re-plan this model"
        )
    cut = _pieces_from_pipe(pipe, [f"stage{s}" for s in range(len(bounds) - 1)])
    cut.pipe = pipe  # type: ignore[attr-defined]
    return cut


def retarget_devices(cut: CutModel, device: torch.device) -> None:
    """A model on meta can only be traced with meta tensors flowing, so its exported pieces carry
    ``device=meta`` constants (``arange``, ``.to(device)``, metadata asserts): point them at the device the
    pieces run on."""
    from torch.fx.node import map_aggregate

    def fix(a: Any) -> Any:
        return device if isinstance(a, torch.device) and a.type == "meta" else a

    for piece in cut.pieces:
        for mod in piece.module.modules():
            graph = getattr(mod, "graph", None)
            if not isinstance(graph, torch.fx.Graph):
                continue
            changed = False
            for node in graph.nodes:
                args, kwargs = map_aggregate(node.args, fix), map_aggregate(node.kwargs, fix)
                if args != node.args or kwargs != node.kwargs:
                    node.args, node.kwargs = args, kwargs
                    changed = True
            if changed:
                gm = mod if isinstance(mod, torch.fx.GraphModule) else getattr(mod, "graph_module", None)
                if isinstance(gm, torch.fx.GraphModule) and gm.graph is graph:
                    gm.recompile()
                elif callable(getattr(mod, "finalize", None)):
                    mod.finalize()  # type: ignore[operator]


def tensor_bytes(values: Any) -> int:
    """Bytes of the tensors in a (nested) value."""
    if isinstance(values, torch.Tensor):
        return values.numel() * values.element_size()
    if isinstance(values, (tuple, list)):
        return sum(tensor_bytes(v) for v in values)
    if isinstance(values, dict):
        return sum(tensor_bytes(v) for v in values.values())
    return 0
