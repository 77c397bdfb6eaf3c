"""Memory and traffic by sharding mode against the published closed forms: ZeRO's (2 + 2 + K) bytes per
parameter, Megatron's 18 and 6 + 12/d, FSDP2 under pipelining, ZeroRedundancyOptimizer's partition."""

from __future__ import annotations

import itertools

import pytest

from stageplan.errors import StageplanError
from stageplan.planning.sharding import (
    bytes_per_param,
    data_parallel_sync,
    padded_vocab,
    ring_time,
    tensor_parallel_block_s,
    zero1_shares,
)

LLAMA3_VOCAB, LLAMA3_HIDDEN = 128256, 8192


@pytest.mark.parametrize("d", [1, 2, 8, 64])
def test_zero_paper_bytes_per_parameter(d: int) -> None:
    # ZeRO (Rajbhandari et al. 2020, section 5): mixed-precision Adam holds (2 + 2 + K) psi with K = 12;
    # ZeRO-1 (optimizer states partitioned) 4 psi + K psi / d
    assert bytes_per_param("bf16-mixed", "adam", "ddp", d).total == 16.0
    assert bytes_per_param("bf16-mixed", "adam", "zero1", d).total == pytest.approx(4 + 12 / d)
    assert bytes_per_param("fp16-mixed", "adamw", "zero1", d).total == pytest.approx(4 + 12 / d)


@pytest.mark.parametrize(("precision", "optimizer", "d"), [("bf16-mixed", "adam", 2),
                                                           ("bf16-mixed", "adamw", 8),
                                                          ("fp16-mixed", "adam", 32)])
def test_megatron_theoretical_memory_under_fp32_gradients(precision: str, optimizer: str, d: int) -> None:
    # megatron/training/theoretical_memory_usage.py: 18 bytes per parameter, or 6 + 12/d with
    # --use-distributed-optimizer (fp32 main gradients, bf16 weights, fp32 master and Adam states)
    assert bytes_per_param(precision, optimizer, "ddp", d, "fp32").total == 18.0
    assert bytes_per_param(precision, optimizer, "zero1", d, "fp32").total == pytest.approx(6 + 12 / d)


@pytest.mark.parametrize("d", [2, 4, 16])
def test_fsdp_under_pipelining_keeps_unsharded_weights_and_gradients(d: int) -> None:
    # stage.py keeps reshard-after-backward off until the last microbatch: 2 (bf16 weights) + 4 (fp32 reduce)
    # + (4 master + 8 states) / d
    assert bytes_per_param("bf16-mixed", "adam", "fsdp", d, "fp32").total == pytest.approx(2 + 4 + 12 / d)
    # fp32: the sharded parameter is the weight itself: 4 + 4 + (4 + 8) / d
    assert bytes_per_param("fp32", "adam", "fsdp", d).total == pytest.approx(8 + 12 / d)
    # and SGD keeps no state: only the sharded weights leave
    assert bytes_per_param("fp32", "sgd", "fsdp", d).total == pytest.approx(8 + 4 / d)


def test_bad_mode_names_are_refused_with_the_choices() -> None:
    with pytest.raises(StageplanError, match=r"unknown sharding 'zero3'; use one of ddp, zero1, fsdp"):
        bytes_per_param("bf16-mixed", "adam", "zero3", 2)
    with pytest.raises(StageplanError, match=r"unknown gradient dtype 'bf16'; use one of param, fp32"):
        bytes_per_param("bf16-mixed", "adam", "ddp", 2, "bf16")


def _brute_force_lpt(numels: list[int], world: int) -> list[int]:
    """ZeroRedundancyOptimizer._partition_parameters written out again: sort largest first (stable), each to
    the first rank of least load."""
    order = sorted(range(len(numels)), key=lambda i: -numels[i])
    loads = [0] * world
    for i in order:
        r = min(range(world), key=lambda k: (loads[k], k))
        loads[r] += numels[i]
    return loads


def test_zero1_puts_a_128k_vocabulary_embedding_whole_on_one_rank() -> None:
    # the first stage of LLaMA-3-70B: the embedding and four blocks' tensors (q, k, v, o, gate, up, down, 2
    # norms)
    emb = LLAMA3_VOCAB * LLAMA3_HIDDEN
    h, kv, inter = LLAMA3_HIDDEN, 1024, 28672
    block = [h * h, h * kv, h * kv, h * h, h * inter, h * inter, inter * h, h, h]
    numels = [emb, *block * 4]
    for d in (2, 4, 8, 16):
        shares = zero1_shares(numels, d)
        assert shares == _brute_force_lpt(numels, d)
        assert sum(shares) == sum(numels)
    # from d = 8 the embedding (1.05 G elements) is more than a fair share (4.47 G / 8 = 0.56 G): it sits
    # alone on one rank, 1.88x the 1/d that a divide-by-d model predicts
    shares = zero1_shares(numels, 8)
    assert max(shares) == emb
    assert max(shares) / (sum(numels) / 8) == pytest.approx(1.879, abs=1e-3)


def test_zero1_partition_matches_brute_force_on_many_shapes() -> None:
    for numels in itertools.product([1, 3, 7, 7, 20], repeat=3):
        for d in (1, 2, 3):
            assert zero1_shares(list(numels), d) == _brute_force_lpt(list(numels), d)


def test_ring_collectives_closed_forms() -> None:
    # all-reduce 2(n-1)/n x bytes / bw + 2(n-1) x latency; all-gather and reduce-scatter half the steps
    assert ring_time(8e9, 8, 1e9, 1e-5) == pytest.approx(2 * 7 / 8 * 8 + 14e-5)
    assert ring_time(8e9, 8, 1e9, 1e-5, "reduce_scatter") == pytest.approx(7 / 8 * 8 + 7e-5)
    assert ring_time(8e9, 1, 1e9) == 0.0


def test_ddp_hides_its_all_reduce_behind_the_last_backward_but_not_the_last_bucket() -> None:
    grads = 4e9
    full = ring_time(grads, 4, 1e10)
    bucket = ring_time(25 * 1024 * 1024, 4, 1e10)
    long_backward = data_parallel_sync("ddp", 4, grads, grads, last_backward_s=10.0,
                                       bandwidth_bytes_per_s=1e10)
    assert long_backward.total_s == pytest.approx(full)
    assert long_backward.exposed_s == pytest.approx(bucket)
    short = data_parallel_sync("ddp", 4, grads, grads, last_backward_s=0.1, bandwidth_bytes_per_s=1e10)
    assert short.exposed_s == pytest.approx(full - 0.1)
    zero1 = data_parallel_sync("zero1", 4, grads, 2e9, last_backward_s=10.0, bandwidth_bytes_per_s=1e10)
    assert zero1.exposed_s == pytest.approx(bucket + 3 / 4 * 2e9 / 1e10)
    fsdp = data_parallel_sync("fsdp", 4, grads, 2e9, last_backward_s=10.0, bandwidth_bytes_per_s=1e10)
    assert fsdp.exposed_s == pytest.approx(3 / 4 * (grads + 2e9) / 1e10)  # both ends exposed
    assert data_parallel_sync("fsdp", 1, grads, 2e9, 1.0, 1e10).total_s == 0.0


def test_megatron_tensor_parallel_traffic() -> None:
    tokens, h, t, bw = 8192, 8192, 4, 450e9
    one = 2 * (t - 1) / t * tokens * h * 2 / bw
    assert tensor_parallel_block_s(tokens, h, 2, t, bw) == pytest.approx((2 * one, 2 * one))
    assert tensor_parallel_block_s(tokens, h, 2, t, bw, recompute=True) == pytest.approx((2 * one, 4 * one))
    assert tensor_parallel_block_s(tokens, h, 2, 1, bw) == (0.0, 0.0)


def test_vocabulary_padding_follows_megatron() -> None:
    assert padded_vocab(128256, 1) == 128256
    assert padded_vocab(128256, 8) == 129024  # next multiple of 128 x 8
    assert padded_vocab(32000, 4) == 32256
