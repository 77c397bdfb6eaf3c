"""The peers' split formats, read back into boundaries: torchtitan's module FQNs per model part, Megatron's
pipeline layout string, torch's split_spec and DeepSpeed/torchgpipe balance lists (no torch)."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from stageplan._io import short_repr
from stageplan.errors import StageplanError

if TYPE_CHECKING:

    pass


# -- inverse of the exports (users scoring the split they run today with another tool, and tests) ------------
def named_layers(layer_names: Sequence[str], meta: dict[str, Any]) -> list[str]:
    """The profile's named blocks (``meta["named_layers"]``); every layer when the profile does not say."""
    named = meta.get("named_layers")
    return list(named) if named else list(layer_names)


def boundaries_from_split_spec(spec: dict[str, str], layer_names: Sequence[str]) -> tuple[int, ...]:
    idx = {n: i for i, n in enumerate(layer_names)}
    idx.update({n.split("+")[0]: i for i, n in enumerate(layer_names)})
    cuts = sorted(idx[k] if v == "BEGINNING" else idx[k] + 1 for k, v in spec.items())
    return (0, *cuts, len(layer_names))


def _layer_list(names: Sequence[str], idx: Sequence[int]) -> str:
    shown = ", ".join(repr(names[i]) for i in idx[:4])
    return shown + (f" and {len(idx) - 4} more" if len(idx) > 4 else "")


def boundaries_from_module_fqns(
    parts: Sequence[Sequence[str]], layer_names: Sequence[str]
) -> tuple[int, ...]:
    """Boundaries from torchtitan's ``module_fqns_per_model_part``
    (one list of module FQNs per stage, in order).

    An FQN names a layer of the profile or one module of a grouped layer (``tok_emb`` of ``tok_emb+pos_emb``).
    Refused, one rule each: an FQN the profile does not have, one listed twice, an empty part, a grouped layer
    split between parts, a part whose layers are not one contiguous run, parts out of the model's order, and
    modules that are in no part.

    >>> boundaries_from_module_fqns([["emb", "b.0"], ["b.1", "head"]], ["emb", "b.0", "b.1", "head"])
    (0, 2, 4)
    """
    example = '[["tok_embeddings", "layers.0"], ["layers.1", "norm", "output"]]'
    if not isinstance(parts, (list, tuple)) or not all(
            isinstance(part, (list, tuple)) and all(isinstance(f, str) for f in part) for part in parts):
        raise StageplanError(f"module FQNs per model part must be a list of lists of module names "
                             f"(torchtitan's module_fqns_per_model_part), got {str(parts)[:80]!r}; e.g. "
                             f"{example}")
    members = [name.split("+") for name in layer_names]
    owner = {fqn: i for i, group in enumerate(members) for fqn in group}
    owner.update({name: i for i, name in enumerate(layer_names)})
    where: dict[str, int] = {}  # module FQN -> part
    for k, part in enumerate(parts):
        if not part:
            raise StageplanError(f"part {k} of the module FQNs is empty; every stage needs at least one "
                                 "layer: drop the empty part and plan one stage fewer")
        for fqn in part:
            if fqn not in owner:
                raise StageplanError(
                    f"part {k} names {fqn!r}, which is no layer of this profile (its layers are "
                    f"{_layer_list(layer_names, list(range(len(layer_names))))}); use the profile's layer "
                    "FQNs, as stageplan plan --export torchtitan writes them")
            for module in members[owner[fqn]] if fqn == layer_names[owner[fqn]] else [fqn]:
                if module in where:
                    twice = f"twice in part {k}" if where[module] == k else (f"in part {where[module]} and "
                                                                             f"in part {k}")
                    raise StageplanError(
                        f"{module!r} is listed {twice}; each module belongs to exactly one part")
                where[module] = k
    layer_part: list[int] = []  # the part holding each layer, -1 when none does
    for i, group in enumerate(members):
        in_parts = sorted({where[m] for m in group if m in where})
        if len(in_parts) > 1:
            raise StageplanError(
                f"{layer_names[i]!r} was profiled as one layer but its modules sit in parts "
                f"{', '.join(map(str, in_parts))}; put them in one part, or profile them as separate layers "
                "(stageplan profile --layers)")
        layer_part.append(in_parts[0] if in_parts else -1)
    end = 0  # where the parts so far end
    for k in range(len(parts)):
        held = [i for i, q in enumerate(layer_part) if q == k]
        if held[0] < end:
            raise StageplanError(
                f"part {k} starts at layer {held[0]} ({layer_names[held[0]]!r}), before part {k - 1} ends "
                f"(layer {end - 1}); parts follow the model's order, the first layers in part 0")
        gaps = [i for i in range(held[0], held[-1] + 1) if layer_part[i] != k]
        if gaps:
            raise StageplanError(
                f"part {k} holds layers {held[0]}..{held[-1]} but not {_layer_list(layer_names, gaps)}; a "
                "stage is one contiguous run of layers")
        end = held[-1] + 1
    absent = [i for i, q in enumerate(layer_part) if q < 0]
    missing = [m for group in members for m in group if m not in where]
    if absent or missing:
        what = _layer_list(layer_names, absent) if absent else ", ".join(repr(m) for m in missing[:4])
        raise StageplanError(f"{what} {'is' if len(absent or missing) == 1 else 'are'} in no part; every "
                             "module of the profile must be in exactly one part")
    bounds = [0]
    for k in range(len(parts)):
        bounds.append(max(i for i, q in enumerate(layer_part) if q == k) + 1)
    return tuple(bounds)


# Megatron's --pipeline-model-parallel-layout symbols
# (megatron/core/transformer/pipeline_parallel_layer_layout.py)
MEGATRON_SYMBOLS = {"E": "embedding", "t": "decoder layer", "L": "loss/head",
                    "m": "multi-token-prediction (MTP) layer"}
# The longest layout read: a count beyond it is a typo, and writing it out would exhaust memory first
MEGATRON_MAX_SYMBOLS = 1_000_000
# groups inside groups (Megatron itself does not nest them); the reader recurses per level
MEGATRON_MAX_DEPTH = 64


def expand_megatron_layout(layout: str) -> list[list[str]]:
    """Megatron's ``--pipeline-model-parallel-layout`` written
    out: one list of symbols per stage (empty stages kept).

    Grammar: symbols E (embedding), t (decoder layer), m (MTP layer), L (loss/head); ``|`` ends a stage;
    ``X*n`` repeats a symbol and ``(...)*n`` a group, which may hold ``|`` and so repeat whole stages, and may
    nest (Megatron itself does not nest groups); commas and spaces are cosmetic.

    >>> expand_megatron_layout("E,t*2|(t|)*2,L")
    [['E', 't', 't'], ['t'], ['t'], ['L']]
    """
    text = "".join(ch for ch in layout if ch not in ", \t")
    pos = 0

    def fail(why: str) -> NoReturn:
        raise StageplanError(f"cannot read Megatron layout {short_repr(layout)}: {why} (at character {pos} "
                             f"of {short_repr(text)}); "
                             "write symbols E, t, m, L, '|' between stages, X*n or (group)*n to repeat, e.g. "
                             "'Et*3|(tt|)*2,tL'")

    def count() -> int:
        nonlocal pos
        digits = re.match(r"\d+", text[pos:])
        if digits is None:
            fail("'*' must be followed by a count")
        pos += len(digits.group())
        if len(digits.group().lstrip("0")) > len(str(MEGATRON_MAX_SYMBOLS)):  # int() refuses past 4300 digits
            fail(f"the count {short_repr(digits.group())} repeats to more than {MEGATRON_MAX_SYMBOLS:,} "
                 "symbols, more layers than any model has; check the counts")
        return int(digits.group().lstrip("0") or "0")

    def sequence(depth: int) -> list[str]:
        nonlocal pos
        out: list[str] = []
        while pos < len(text):
            ch = text[pos]
            if ch == ")":
                if depth == 0:
                    fail("')' without '('")
                return out
            pos += 1
            if ch == "|":
                if pos < len(text) and text[pos] == "*":
                    fail("'*n' must follow a symbol or a parenthesised group, not '|'")
                out.append("|")
                continue
            if ch == "(":
                if depth >= MEGATRON_MAX_DEPTH:
                    fail(f"groups nest deeper than {MEGATRON_MAX_DEPTH} levels; write the layout with fewer "
                         f"'('")
                item = sequence(depth + 1)
                if pos >= len(text):
                    fail("'(' without ')'")
                pos += 1
                if not item:
                    fail("empty group '()'")
            elif ch in MEGATRON_SYMBOLS:
                item = [ch]
            elif ch == "*":
                pos -= 1
                fail("'*n' must follow a symbol or a parenthesised group")
            else:
                pos -= 1
                fail(f"unknown symbol {ch!r}")
            if pos < len(text) and text[pos] == "*":
                pos += 1
                n = count()
                if len(out) + len(item) * n > MEGATRON_MAX_SYMBOLS:
                    fail(f"it repeats to more than {MEGATRON_MAX_SYMBOLS:,} symbols ({len(item):,} x {n:,}), "
                         "more layers than any model has; check the counts")
                item = item * n
            if len(out) + len(item) > MEGATRON_MAX_SYMBOLS:
                fail(f"it writes out to more than {MEGATRON_MAX_SYMBOLS:,} symbols, more layers than any "
                     "model has; check the counts")
            out.extend(item)
        if depth:
            fail("'(' without ')'")
        return out

    stages: list[list[str]] = [[]]
    for sym in sequence(0):
        if sym == "|":
            stages.append([])
        else:
            stages[-1].append(sym)
    return stages


def megatron_symbols(layer_names: Sequence[str], named: Sequence[str]) -> list[str | None]:
    """The Megatron symbol of each profiled layer: E the code before the named blocks (the first layer), t a
    named block, L the code after them (the last layer); None for a layer no symbol stands for."""
    is_named = set(named)
    last = len(layer_names) - 1
    return ["t" if n in is_named else "E" if i == 0 else "L" if i == last else None for i,
            n in enumerate(layer_names)]


def _symbol_counts(symbols: Sequence[str | None]) -> str:
    return ", ".join(f"{symbols.count(s)} {s}" for s in "EtL" if symbols.count(s)) or "no E, t or L"


def boundaries_from_megatron(layout: str, layer_names: Sequence[str] | None = None,
                             named: Sequence[str] | None = None) -> tuple[int, ...]:
    """Boundaries from Megatron's ``--pipeline-model-parallel-layout`` (see :func:`expand_megatron_layout`).

    With ``layer_names`` (and the profile's ``named`` blocks), each symbol is mapped onto the profile's
    layers: E the first layer, t each named block, L the last layer; a layout whose symbols do not match the
    profile's is refused with both counts. Stages must be non-empty; m (MTP) has no layer in a stageplan
    profile.

    >>> boundaries_from_megatron("E,t*4|t*4,L")
    (0, 5, 10)
    """
    stages = expand_megatron_layout(layout)
    flat = [s for stage in stages for s in stage]
    if "m" in flat:
        raise StageplanError(
            f"Megatron layout {layout!r} holds 'm', a multi-token-prediction (MTP) layer; a stageplan "
            "profile has no MTP layer to map it onto (E is the first layer, t each named block, L the last "
            "layer): score the layout without its m symbols (and without a stage that holds only m)")
    if not flat:
        raise StageplanError(f"Megatron layout {layout!r} holds no layers; write one symbol per layer and "
                             "'|' between stages, e.g. 'E,t*4|t*4,L'")
    empty = [k for k, stage in enumerate(stages) if not stage]
    if empty:
        raise StageplanError(
            f"Megatron layout {layout!r} has {len(stages)} stages and stage {empty[0]} is empty; Megatron "
            "allows empty stages, a stageplan split needs at least one layer per stage: drop that stage's "
            "'|' and plan one stage fewer")
    if layer_names is not None:
        profile = megatron_symbols(layer_names, list(layer_names) if named is None else named)
        odd = [i for i, s in enumerate(profile) if s is None]
        if odd:
            raise StageplanError(
                f"layer {odd[0]} of the profile ({layer_names[odd[0]]!r}) is neither the first layer, the "
                "last layer nor a named block, so no Megatron symbol stands for it; score this split with "
                "--boundaries or --fqns")
        if flat != profile:
            if _symbol_counts(flat) != _symbol_counts(profile):
                raise StageplanError(
                    f"Megatron layout {layout!r} has {_symbol_counts(flat)} ({len(flat)} layers) but the "
                    f"profile has {_symbol_counts(profile)} ({len(profile)} layers: E = {layer_names[0]!r}, "
                    f"t = each named block, L = {layer_names[-1]!r}); write a layout with "
                    f"{_symbol_counts(profile)}")
            i = next(i for i, (a, b) in enumerate(zip(flat, profile)) if a != b)
            raise StageplanError(
                f"Megatron layout {layout!r} has {flat[i]!r} at layer {i} where the profile has {profile[i]} "
                f"({layer_names[i]!r}); E comes first, L last, t in between")
    out = [0]
    for stage in stages:
        out.append(out[-1] + len(stage))
    return tuple(out)


def boundaries_from_balance(balance: Sequence[int]) -> tuple[int, ...]:
    out = [0]
    for s in balance:
        out.append(out[-1] + int(s))
    return tuple(out)


def read_fqns(path: str | os.PathLike[str]) -> Any:
    """torchtitan's module_fqns_per_model_part from a JSON file: the list itself, or an object holding it
    under that key (as --export torchtitan prints the list)."""
    from pathlib import Path

    p = Path(path)
    if not str(path).strip() or p.is_dir():
        raise StageplanError(f"--fqns {str(path)!r} is {'a folder' if str(path).strip() else 'empty'}; give "
                             "the JSON file of the parts, e.g. from stageplan plan PROFILE.json --stages N "
                             "--export torchtitan > FQNS.json")
    if not p.is_file():
        raise StageplanError(f"FQN file {str(p)!r} does not exist; write the parts there, e.g. with "
                             "stageplan plan PROFILE.json --stages N --export torchtitan > FQNS.json")
    try:
        data = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        why = (
            "nests deeper than Python reads"
            if isinstance(exc, RecursionError)
            else f"is not valid JSON ({exc})"
        )
        raise StageplanError(
            f"FQN file {str(p)!r} {why}; write a JSON list of lists of module FQNs"
        ) from None
    if isinstance(data, dict) and "module_fqns_per_model_part" in data:
        data = data["module_fqns_per_model_part"]
    return data
