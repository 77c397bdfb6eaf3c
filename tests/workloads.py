"""Workload factories used by the multi-process tests (importable by the rank processes)."""

from __future__ import annotations

import torch
from torch import nn

import stageplan


class FailingLayer(nn.Module):
    """A layer that raises on its ``fail_at``-th forward call (a bad layer deep inside a run)."""

    def __init__(self, width: int, fail_at: int, kill: bool = False, hang: bool = False) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.fail_at = fail_at
        self.kill = kill
        self.hang = hang
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls > self.fail_at:
            if self.hang:  # a layer that never returns (a deadlock, a stuck collective)
                import time

                time.sleep(10**6)
            if self.kill:  # the process dies without a word, as under the OOM killer
                import os
                import signal

                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"bad layer: forward call {self.calls}")
        return self.linear(x)


def faulty(fail_step: int = 2, num_microbatches: int = 2, width: int = 16, batch_size: int = 8,
           kill: bool = False, hang: bool = False) -> stageplan.Workload:
    """Four layers; the last one raises (or SIGKILLs its process) in step ``fail_step`` (0-based), i.e. after
    fail_step * m calls."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width),
                          FailingLayer(width, fail_step * num_microbatches, kill, hang))
    return stageplan.Workload(model, torch.randn(batch_size, width), torch.randn(batch_size, width),
                              nn.functional.mse_loss, name="faulty")


def mlp(width: int = 16, depth: int = 4, batch_size: int = 8) -> stageplan.Workload:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    model = nn.Sequential(*layers)
    return stageplan.Workload(model, torch.randn(batch_size, width), torch.randn(batch_size, width),
                              nn.functional.mse_loss, name="mlp")


def notarget(width: int = 32, batch_size: int = 8) -> stageplan.Workload:
    """No target and no loss function: the default loss (mean square of the output) drives the backward."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.Tanh())
    return stageplan.Workload(model, torch.randn(batch_size, width), name="notarget")


def big(width: int = 32, depth: int = 4, batch_size: int = 8) -> stageplan.Workload:
    """A model given only as model_fn, as for a model too big to build: stageplan builds it on meta."""
    torch.manual_seed(0)

    def build() -> nn.Module:
        return nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])

    return stageplan.Workload(None, torch.randn(batch_size, width), torch.randn(batch_size, width),
                              nn.functional.mse_loss, name="big", model_fn=build)


class TiedBlocks(nn.Module):
    """Five Linear + Tanh blocks in a ModuleList (cut by export); block ``tie_with`` uses block 0's weight."""

    def __init__(self, width: int, tie_with: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(5))
        self.blocks[tie_with][0].weight = self.blocks[0][0].weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def tied_blocks(tie_with: int = 4, width: int = 16, batch_size: int = 8) -> stageplan.Workload:
    """A tie between block 0 and block ``tie_with`` (2 or 4):
    one that a split keeps on one rank or puts on two."""
    torch.manual_seed(0)
    return stageplan.Workload(TiedBlocks(width, tie_with), torch.randn(batch_size, width),
                              torch.randn(batch_size, width), nn.functional.mse_loss, name="tied_blocks")


def sleepy(seconds: float = 60.0) -> stageplan.Workload:
    """A factory that takes ``seconds`` to build (a download or a deadlock inside the user's own code)."""
    import time

    time.sleep(seconds)
    return mlp()


class _SleepGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seconds):  # type: ignore[no-untyped-def, override]
        ctx.seconds = seconds
        return x.clone()

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def, override]
        import time

        # a number of seconds, or a function that says how many when the backward runs (Evictee)
        time.sleep(ctx.seconds() if callable(ctx.seconds) else ctx.seconds)
        return g, None


class Sleeper(nn.Module):
    """A layer of known cost: it sleeps ``forward_s`` in its forward and ``backward_s`` in its backward."""

    def __init__(self, forward_s: float, backward_s: float) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))
        self.forward_s, self.backward_s = forward_s, backward_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import time

        time.sleep(self.forward_s)
        return _SleepGrad.apply(x * self.w, self.backward_s)


def sleepers(forward_ms: str = "20,2", backward_ms: str = "20,2", batch_size: int = 4) -> stageplan.Workload:
    """Layers of known cost (comma-separated milliseconds, one per layer): sleeping, so the two ranks' times
    do not depend on the machine's speed or on sharing its cores."""
    fwd = [float(x) / 1e3 for x in forward_ms.split(",")]
    bwd = [float(x) / 1e3 for x in backward_ms.split(",")]
    model = nn.Sequential(*[Sleeper(f, b) for f, b in zip(fwd, bwd)])
    return stageplan.Workload(model, torch.ones(batch_size, 4), torch.zeros(batch_size, 4),
                              nn.functional.mse_loss, name="sleepers")


_LAST: list[object] = [None]  # the last Evictee call in this process: ("f" or "b", the layer's id)


class Evictee(nn.Module):
    """A layer whose backward costs ``hot_s`` right after its own forward and ``cold_s`` after anything else
    (another Evictee's forward or backward): the order it is timed in decides its cost, as a cache its saved
    activations fall out of does. It sleeps ``forward_s`` in its forward."""

    def __init__(self, forward_s: float, hot_s: float, cold_s: float) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))
        self.forward_s, self.hot_s, self.cold_s = forward_s, hot_s, cold_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import time

        time.sleep(self.forward_s)
        out = _SleepGrad.apply(x * self.w, self._backward_s)
        _LAST[0] = ("f", id(self))
        return out

    def _backward_s(self) -> float:
        """Called as its backward runs: hot if the last Evictee call was its own forward."""
        hot = _LAST[0] == ("f", id(self))
        _LAST[0] = ("b", id(self))
        return self.hot_s if hot else self.cold_s


def evictees(layers: int = 4, forward_ms: float = 1.0, hot_ms: float = 2.0, cold_ms: float = 6.0,
             batch_size: int = 4) -> stageplan.Workload:
    """``layers`` identical Evictees: timed in a stage's order every backward but the last is cold."""
    model = nn.Sequential(*[Evictee(forward_ms / 1e3, hot_ms / 1e3, cold_ms / 1e3) for _ in range(layers)])
    return stageplan.Workload(model, torch.ones(batch_size, 4), torch.zeros(batch_size, 4),
                              nn.functional.mse_loss, name="evictees")
