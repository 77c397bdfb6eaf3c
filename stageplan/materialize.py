"""Models bigger than the machine: build with parameters on meta, then give real tensors only to the
parameters a layer or a stage uses, from a checkpoint or from a deterministic initialisation keyed by FQN
(torch)."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from stageplan.errors import StageplanError, WorkloadError


@contextlib.contextmanager
def init_empty_weights() -> Iterator[None]:
    """Inside the block, every parameter a module registers is put on the meta device; buffers and every other
    tensor (the example inputs a factory builds beside its model) stay real.

    This is accelerate's ``init_empty_weights(include_buffers=False)`` patch of
    ``nn.Module.register_parameter`` (accelerate/big_modeling.py), with one change: a parameter that is
    already on meta is registered as it is. accelerate re-wraps it, which unties tied weights (an embedding
    shared with the LM head becomes two
    parameters, so the model counts one parameter more than it has).
    """
    original = nn.Module.register_parameter

    def register_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            p = module._parameters[name]
            assert p is not None
            kwargs = dict(p.__dict__)
            kwargs["requires_grad"] = param.requires_grad
            module._parameters[name] = type(p)(p.to("meta"), **kwargs)

    nn.Module.register_parameter = register_parameter  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters are on meta (ties kept, buffers copied): never two real copies."""
    memo: dict[int, Any] = {}
    for p in {id(p): p for p in model.parameters()}.values():
        memo[id(p)] = nn.Parameter(p.detach().to("meta"), requires_grad=p.requires_grad)
    return copy.deepcopy(model, memo)


def meta_model(workload: Any) -> nn.Module:
    """The workload's model with parameters on meta: built by its ``model_fn`` inside
    :func:`init_empty_weights`, or a weightless copy of its real model. Never a second real copy."""
    if workload.model is not None:
        return meta_copy(workload.model)
    with init_empty_weights():
        model = workload.model_fn()
    if not isinstance(model, nn.Module):
        raise WorkloadError(f"model_fn returned {type(model).__name__}, not a torch.nn.Module")
    return model


def real_model(workload: Any) -> nn.Module:
    """The workload's model for real: its model, or what its
    ``model_fn`` builds (the user's own initialisation)."""
    if workload.model is not None:
        return workload.model
    model = workload.model_fn()
    if not isinstance(model, nn.Module):
        raise WorkloadError(f"model_fn returned {type(model).__name__}, not a torch.nn.Module")
    return model


def parameter_bytes(model: nn.Module) -> int:
    """Bytes of the model's distinct parameters (meta ones included: their shapes and dtypes are real)."""
    return sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())


def _registration_order(model: nn.Module) -> dict[str, int]:
    return {name: k for k, (name, _) in enumerate(model.named_parameters(remove_duplicate=False))}


def tied_names(model: nn.Module) -> dict[str, list[str]]:
    """For every parameter FQN, all FQNs naming the same parameter (itself first)."""
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return {name: [name, *(n for n in group if n != name)] for group in groups.values() for name in group}


# --------------------------------------------------------------------------------------------------
# Where real tensors come from


class Checkpoint:
    """Tensors by FQN from a safetensors file, an HF folder (``model.safetensors.index.json`` or one
    ``model.safetensors``) or a state dict; reads only the tensors asked for."""

    def __init__(self, source: str | os.PathLike[str] | Mapping[str, torch.Tensor]) -> None:
        self._dict: Mapping[str, torch.Tensor] | None = None
        self._files: dict[str, Path] = {}
        if isinstance(source, Mapping):
            self._dict = source
            return
        path = Path(source)
        if path.is_dir():
            index = path / "model.safetensors.index.json"
            single = path / "model.safetensors"
            if index.is_file():
                try:
                    weight_map = json.loads(index.read_text())["weight_map"]
                    if not isinstance(weight_map, dict):
                        raise TypeError(f"weight_map is {type(weight_map).__name__}, not an object")
                except (json.JSONDecodeError, KeyError, TypeError) as exc:
                    raise StageplanError(
                        f"{str(index)!r} is not an HF safetensors index ({exc}); "
                        "point --weights at a .safetensors file or an HF model folder"
                    ) from None
                self._files = {k: path / v for k, v in weight_map.items()}
            elif single.is_file():
                self._files = dict.fromkeys(self._keys_of(single), single)
            else:
                raise StageplanError(f"folder {str(path)!r} has neither model.safetensors.index.json nor "
                                     "model.safetensors; point --weights at a .safetensors file or an HF "
                                     "model folder")
        elif path.is_file():
            self._files = dict.fromkeys(self._keys_of(path), path)
        else:
            raise StageplanError(
                f"weights {str(path)!r} do not exist; give a .safetensors file or an HF model folder")

    @staticmethod
    def _keys_of(path: Path) -> list[str]:
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                return list(f.keys())
        except Exception as exc:  # safetensors raises its own error types for a file that is not one
            raise StageplanError(f"{str(path)!r} is not a safetensors file ({type(exc).__name__}: {exc}); "
                                 "save weights with safetensors.torch.save_file") from None

    @property
    def owns_tensors(self) -> bool:
        """Tensors read from files are fresh; a state dict's belong to the caller."""
        return self._dict is None

    def keys(self) -> set[str]:
        return set(self._dict) if self._dict is not None else set(self._files)

    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The named tensors (each read once from its file)."""
        wanted = list(dict.fromkeys(names))
        if self._dict is not None:
            return {n: self._dict[n] for n in wanted}
        by_file: dict[Path, list[str]] = {}
        for n in wanted:
            by_file.setdefault(self._files[n], []).append(n)
        out: dict[str, torch.Tensor] = {}
        for path, names_in_file in by_file.items():
            out.update(_read_safetensors(path, names_in_file))
        return out


# safetensors' dtype names (its format spec: an 8-byte little-endian header length, a JSON header of
# {name: {dtype, shape, data_offsets}}, then the data).
_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}


def _read_safetensors(path: Path, names: list[str]) -> dict[str, torch.Tensor]:
    """The named tensors, each read straight into its own buffer. safetensors' safe_open maps the file, and
    the mapped pages count in the process's resident set on top of the copies (about the stage's size again at
    a rank's peak), so plain reads keep a rank's peak to its own tensors."""
    out: dict[str, torch.Tensor] = {}
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
        base = 8 + header_len
        for name in sorted(names, key=lambda n: header[n]["data_offsets"][0]):
            entry = header[name]
            dtype = _ST_DTYPES.get(entry["dtype"])
            if dtype is None:
                raise StageplanError(f"tensor {name!r} in {str(path)!r} has dtype {entry['dtype']}, which "
                                     f"stageplan cannot read; use one of {', '.join(_ST_DTYPES)}")
            start, end = entry["data_offsets"]
            t = torch.empty(entry["shape"], dtype=dtype)
            f.seek(base + start)
            buffer = t.reshape(-1).view(torch.uint8).numpy().data  # the tensor's own bytes, written in place
            if f.readinto(buffer) != end - start:
                raise StageplanError(
                    f"{str(path)!r} ends inside tensor {name!r}; the file is truncated: save it again")
            out[name] = t
    return out


def save_checkpoint(model: nn.Module, path: str | Path) -> None:
    """The model's parameters and persistent buffers as safetensors, each tied tensor stored once (under its
    first name), as HF stores a tied LM head: safetensors refuses shared tensors."""
    save_tensors([*model.named_parameters(remove_duplicate=False), *model.state_dict(keep_vars=True).items()],
                 path)


def save_tensors(named: Iterable[tuple[str, torch.Tensor]], path: str | os.PathLike[str]) -> None:
    """Named tensors as safetensors, each stored once: names that share memory (a tie, or a state dict's
    detached aliases of one tied parameter) keep the first name; a reader resolves the others through the
    model's ties."""
    from safetensors.torch import save_file

    seen: set[tuple[int, int, tuple[int, ...], torch.dtype]] = set()
    tensors: dict[str, torch.Tensor] = {}
    for name, t in named:
        key = (t.untyped_storage().data_ptr(), int(t.storage_offset()), tuple(int(x) for x in t.shape),
               t.dtype)
        if name in tensors or key in seen:
            continue
        seen.add(key)
        tensors[name] = t.detach().contiguous()
    save_file(tensors, str(path))


# --------------------------------------------------------------------------------------------------
# Deterministic initialisation keyed by FQN


def _fqn_seed(seed: int, fqn: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(fqn.encode())) % (2**63 - 1)


def _owner(fqn: str) -> tuple[str, str]:
    owner, _, leaf = fqn.rpartition(".")
    return owner, leaf


def initialize_by_fqn(model: nn.Module, fqns: Iterable[str], device: torch.device | str, *, seed: int = 0,
                      init_fn: Callable[[nn.Module], None] | None = None) -> dict[str, torch.Tensor]:
    """Real tensors for the parameters ``fqns`` of a meta ``model``, the same wherever they are made.

    Each owning submodule is materialised alone (``to_empty``), filled with a defined value (normal(0, 0.02)
    for matrices, ones for 1-D weights, zeros for the rest), then initialised by the model's own rule under an
    RNG seeded by the submodule's FQN: HF models' ``_init_weights``, else the module's ``reset_parameters``.
    Never timing uninitialised memory matters: it can hold denormal floats, on which CPU arithmetic runs far
    slower (a LLaMA layer ran 15x slower on uninitialised weights, measured on a 2-core CPU host).
    The global RNG state is restored afterwards.
    """
    dev = torch.device(device)
    hf_init: Any = init_fn or getattr(model, "_init_weights", None)
    by_owner: dict[str, list[str]] = {}
    for fqn in fqns:
        owner, _ = _owner(fqn)
        by_owner.setdefault(owner, []).append(fqn)
    out: dict[str, torch.Tensor] = {}
    cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=cuda):  # every RNG the seeding touches is restored afterwards
        for owner, names in by_owner.items():
            sub = copy.deepcopy(model.get_submodule(owner) if owner else model)
            direct = dict(sub.named_parameters(recurse=False))
            for leaf in direct:
                sub._parameters[leaf] = nn.Parameter(torch.empty_like(direct[leaf], device=dev),
                                                     requires_grad=direct[leaf].requires_grad)
            gen = torch.Generator(device="cpu").manual_seed(_fqn_seed(seed, owner))
            with torch.no_grad():
                for leaf, p in sub.named_parameters(recurse=False):
                    if p.dim() >= 2 and p.device.type == "cpu" and p.dtype == torch.float32:
                        # drawn in place: torch.randn is empty().normal_(), so these are its values, without
                        # a temporary of the parameter's size (2.18 GB beside a 152k x 3584 fp32 head)
                        p.normal_(generator=gen).mul_(0.02)
                    elif p.dim() >= 2:  # drawn in fp32 on the CPU generator, then cast and moved
                        p.copy_(
                            torch.randn(p.shape, generator=gen, dtype=torch.float32).mul_(0.02).to(p.dtype))
                    elif leaf.endswith("weight"):
                        p.fill_(1.0)
                    else:
                        p.zero_()
            torch.manual_seed(_fqn_seed(seed, owner))
            with torch.no_grad():
                if callable(hf_init):
                    with contextlib.suppress(Exception):  # HF's rule may not know a custom submodule
                        hf_init(sub)
                elif hasattr(sub, "reset_parameters"):
                    sub.reset_parameters()  # type: ignore[operator]
            for fqn in names:
                _, leaf = _owner(fqn)
                out[fqn] = sub._parameters[leaf].detach()  # type: ignore[union-attr]
    return out


# --------------------------------------------------------------------------------------------------
# Giving a module (a layer, a stage, or the whole model) its real parameters


# torch.export's unflattening names the second and later calls of one submodule ``name@1``, ``name@2``
# (torch/export/unflatten.py, _call_name): an exported piece of a block that runs its Linear three times holds
# ``lin``, ``lin@1`` and ``lin@2``, all three the model's one ``lin``.
_CALL_SUFFIX = re.compile(r"@\d+(?=\.|$)")


def model_fqn(model: nn.Module, fqn: str) -> str:
    """The ``model``'s own FQN for a parameter FQN as an exported piece names it: ``blocks.5.lin@1.weight`` is
    ``blocks.5.lin.weight`` (the second call of ``lin``); a name the model holds is its own.

    >>> model_fqn(nn.Sequential(nn.Linear(2, 2)), "0@2.weight")
    '0.weight'
    """
    if "@" not in fqn or fqn in _registration_order(model):
        return fqn
    return _CALL_SUFFIX.sub("", fqn)


def real_parameters(model: nn.Module, fqns: Iterable[str], device: torch.device | str, *,
                    weights: Checkpoint | None = None, seed: int = 0) -> dict[str, torch.Tensor]:
    """Tensors for the parameters ``fqns`` of the (meta) ``model``: read from ``weights`` (a tied parameter is
    read through whichever of its names the checkpoint holds), or initialised by FQN without weights. A later
    call's name (``lin@1.weight``, see :func:`model_fqn`) gets the same tensor as the module's own name."""
    asked = list(dict.fromkeys(fqns))
    own = {n: model_fqn(model, n) for n in asked}
    made = _real_parameters(model, list(dict.fromkeys(own.values())), device, weights=weights, seed=seed)
    return {n: made[own[n]] for n in asked}


def _real_parameters(model: nn.Module, names: list[str], device: torch.device | str, *,
                     weights: Checkpoint | None, seed: int) -> dict[str, torch.Tensor]:
    aliases = tied_names(model)
    if weights is None:
        # a tied parameter is initialised once, under its first name, and every alias gets that tensor: the
        # stages that hold an embedding and the LM head tied to it start from the same values, as the
        # reference does
        first = {n: min(aliases.get(n, [n]), key=_registration_order(model).__getitem__) for n in names}
        made = initialize_by_fqn(model, sorted(set(first.values())), device, seed=seed)
        return {n: made[first[n]] for n in names}
    have = weights.keys()
    source: dict[str, str] = {}
    missing = []
    for fqn in names:
        found = next((a for a in aliases.get(fqn, [fqn]) if a in have), None)
        if found is None:
            missing.append(fqn)
        else:
            source[fqn] = found
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise StageplanError(f"the weights lack {len(missing)} tensor(s) this stage needs: {shown}; "
                             "use a checkpoint of this model (saved from its state_dict)")
    tensors = weights.read(source.values())
    out = {}
    for fqn, key in source.items():
        # never train the caller's tensors
        t = tensors[key] if weights.owns_tensors else tensors[key].detach().clone()
        expected = _meta_parameter(model, fqn)
        if tuple(t.shape) != tuple(expected.shape):
            raise StageplanError(f"weights tensor {key!r} has shape {tuple(t.shape)}, the model's {fqn!r} "
                                 f"{tuple(expected.shape)}; use a checkpoint of this model and these options")
        out[fqn] = t.to(device=device, dtype=expected.dtype)
    return out


def _meta_parameter(model: nn.Module, fqn: str) -> torch.Tensor:
    owner, leaf = _owner(fqn)
    p = (model.get_submodule(owner) if owner else model)._parameters.get(leaf)
    if p is None:
        raise WorkloadError(f"the model has no parameter {fqn!r}")
    return p


def materialize_(module: nn.Module, tensors: Mapping[str, torch.Tensor]) -> nn.Module:
    """Replace ``module``'s meta parameters, named by the original model's FQNs, with the given tensors, which
    it takes over (pass fresh ones, as :func:`real_parameters` returns; a parameter used under two names stays
    one parameter). Buffers are left as they are: they were built real."""
    made: dict[int, nn.Parameter] = {}
    for name, p in list(module.named_parameters(remove_duplicate=False)):
        if p.device.type != "meta":
            continue
        if id(p) not in made:
            if name not in tensors:
                raise WorkloadError(f"no tensor for parameter {name!r}; this is a bug in stageplan")
            made[id(p)] = nn.Parameter(tensors[name], requires_grad=p.requires_grad)  # fresh tensors: no copy
        owner, leaf = _owner(name)
        (module.get_submodule(owner) if owner else module)._parameters[leaf] = made[id(p)]
    return module


def meta_parameter_names(module: nn.Module) -> list[str]:
    """FQNs of the parameters of ``module`` that are still on meta."""
    return [n for n, p in module.named_parameters(remove_duplicate=False) if p.device.type == "meta"]
