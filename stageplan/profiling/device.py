"""The profiling device and dtype, parsed from the CLI's words:
cpu, cuda[:N], or estimate:GPU for a GPU you do not have."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from stageplan.errors import StageplanError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


ESTIMATE_PREFIX = "estimate:"  # --device estimate:GPU: an analytic estimate for that GPU, nothing runs

class DeviceError(StageplanError):
    """The requested device is not available here."""


def parse_device(device: str | torch.device) -> torch.device:
    """'cpu', 'cuda' or 'cuda:i', refused with a clear line when CUDA or that index is not present."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise DeviceError(f"unknown device {device!r}; use cpu, cuda, cuda:N or estimate:GPU (e.g. "
                          f"estimate:h100-sxm)") from exc
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise DeviceError(f"device {str(device)!r} asked for, but this machine has no CUDA GPU "
                              f"(torch {torch.__version__}); use --device cpu, estimate for a GPU (--device "
                              "estimate:h100-sxm) or run on a GPU machine")
        if dev.index is not None and dev.index >= count:
            raise DeviceError(f"device {str(device)!r} asked for, but only {count} CUDA device(s) exist "
                              f"(0..{count - 1}); pick one of those")
    elif dev.type != "cpu":
        raise DeviceError(f"device type {dev.type!r} is not supported; use cpu, cuda, cuda:N or estimate:GPU")
    return dev


def is_estimate_device(device: str | torch.device) -> bool:
    """True for 'estimate:NAME': nothing runs for real, every layer is estimated for GPU NAME."""
    return isinstance(device, str) and device.strip().lower().startswith(ESTIMATE_PREFIX)


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise StageplanError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


@contextlib.contextmanager
def default_dtype(dtype: str | torch.dtype | None) -> Iterator[None]:
    """Build under ``dtype`` as torch's default (parameters are created in it, nothing is cast), then restore
    it. ``.to(dtype)`` on a model also casts floating buffers, including those it computes in float32 on
    purpose (HF LLaMA's rotary ``inv_freq``: cast to bfloat16 it loses precision, and the rotary angles come
    out wrong)."""
    dt = parse_dtype(dtype)
    before = torch.get_default_dtype()
    if dt is not None:
        torch.set_default_dtype(dt)
    try:
        yield
    finally:
        torch.set_default_dtype(before)
