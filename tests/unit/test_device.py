"""stageplan.profiling.device: a CUDA device asked for on a machine without a GPU is refused in one line."""

from __future__ import annotations

import pytest
import torch

from stageplan import profile_model
from stageplan.profiling.device import DeviceError
from stageplan.zoo import gpt


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_cuda_without_gpu_is_refused() -> None:
    with pytest.raises(DeviceError, match=r"no CUDA GPU .* use --device cpu"):
        profile_model(gpt(n_layer=1), microbatch_size=2, device="cuda")
