"""Models bigger than the machine: profile LLaMA-2-7B layer at a time on this CPU (27 GB of fp32 parameters on
a 24 GiB machine) and Qwen2-7B's shape from the CLI, and estimate LLaMA-2-70B for an H100 SXM without running
it. Prints wall time, peak RSS and how many blocks were measured once for all. Not a unit test: each part runs
in a fresh process (peak RSS is a process's own), and the 7B parts take minutes.

    python benchmarks/bench_large.py            # every part, recorded (section "large" of a record)
    python benchmarks/bench_large.py --part 70b # one part, printed only

Goals: 7B (seq 128, microbatch 1, streaming, dedup, default repeats): peak RSS <= 8 GB, <= 15 minutes, 32
blocks, 30 of them measured_as the second (the first two are measured: the first follows another kind of
layer). 70B (seq 4096, microbatch 1 of a batch of 8, bfloat16, estimate:h100-sxm):
<= 2 minutes, peak RSS <= 4 GB; the profile is written to profiles/estimate/llama2-70b-h100-sxm.json.
Qwen2-7B (152k vocabulary, untied: a 2.2 GB fp32 head), `stageplan profile hf --set preset=qwen2-7b --set
seq_len=128 --microbatch-size 1`: peak RSS <= 8 GB, <= 15 minutes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import results

ROOT = Path(__file__).resolve().parents[1]
ESTIMATE_OUT = ROOT / "profiles" / "estimate" / "llama2-70b-h100-sxm.json"

# The published shapes (config.json of meta-llama/Llama-2-7b-hf and Llama-2-70b-hf).
LLAMA2: dict[str, dict[str, Any]] = {
    "7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=32),
    "70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8),
}


def _llama_workload(size: str, *, seq_len: int, batch_size: int, dtype: str) -> Any:
    """The ``hf`` workload's preset where this stageplan has it; else the same model built here: LLaMA-2 of
    ``size`` from its LlamaConfig with parameters on meta, SDPA attention, no cache, a forward returning the
    logits, real token ids and the next token as target."""
    import torch
    import torch.nn.functional as F

    from stageplan import Workload
    from stageplan.materialize import init_empty_weights
    from stageplan.profiling.profiler import default_dtype
    from stageplan.zoo import BUILTINS, build_workload

    if "hf" in BUILTINS:
        with default_dtype(dtype), init_empty_weights():
            return build_workload("hf", {"preset": f"llama2-{size}", "seq_len": seq_len,
                                         "batch_size": batch_size, "dtype": dtype})
    import transformers

    class LlamaLogits(transformers.LlamaForCausalLM):
        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            return super().forward(input_ids=input_ids).logits

    config = transformers.LlamaConfig(**LLAMA2[size], vocab_size=32000, max_position_embeddings=4096,
                                      rms_norm_eps=1e-5, use_cache=False, tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    with default_dtype(dtype), init_empty_weights():
        model = LlamaLogits(config)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 32000, (batch_size, seq_len + 1), generator=gen)

    def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))

    return Workload(model, tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), lm_loss,
                    name=f"llama2-{size}",
                    factory_options={"preset": f"llama2-{size}", "seq_len": seq_len, "batch_size": batch_size,
                                     "dtype": dtype})


def part_7b() -> dict[str, float]:
    import torch

    from stageplan.materialize import parameter_bytes
    from stageplan.profiling.memory import free_bytes, peak_rss_bytes
    from stageplan.profiling.profiler import profile_model

    t0 = time.perf_counter()
    wl = _llama_workload("7b", seq_len=128, batch_size=8, dtype="float32")  # microbatches of 1 are profiled
    print(f"  built on meta: {parameter_bytes(wl.model) / 1e9:.1f} GB of fp32 parameters, "
          f"{free_bytes(torch.device('cpu')) / 1e9:.1f} GB free; {time.perf_counter() - t0:.1f} s",
          flush=True)
    prof = profile_model(wl, microbatch_size=1, progress=True)  # streaming chosen by the memory rule
    wall = time.perf_counter() - t0
    blocks = [x for x in prof.layers if ".layers." in f".{x.name}"]
    second = blocks[1].name if len(blocks) > 1 else None
    reused = sum(1 for x in blocks if x.measured_as == second)
    spread = prof.meta.get("dedup_spread") or {}
    print(f"  materialized: {prof.meta['materialized']} "
          f"({prof.meta.get('memory_check', {}).get('rule', 'forced')})")
    print(
        f"  wall time {wall:.0f} s (goal <= 900 s); peak RSS {peak_rss_bytes() / 1e9:.2f} GB (goal <= 8 GB)")
    print(f"  {len(blocks)} blocks (goal 32), {reused} measured_as {second} (goal 30); "
          f"{prof.meta['layers_measured']} of {len(prof)} layers measured; "
          f"spread {spread.get('layer')} / {spread.get('vs')}: fwd {spread.get('forward_ratio', 0):.3f}, "
          f"bwd {spread.get('backward_ratio', 0):.3f}")
    for x in prof.layers[:2] + prof.layers[-1:]:
        print(f"  {x.name:22s} fwd {x.forward_s * 1e3:8.1f} ms  bwd {x.backward_s * 1e3:8.1f} ms  "
              f"act {x.activation_bytes / 2**20:7.1f} MiB  params {x.param_bytes / 2**20:7.1f} MiB")
    print(f"  load average at the end {prof.meta['load_average_1min']:.2f} (2 shared cores)")
    return {"llama2_7b_s": wall, "llama2_7b_peak_rss_gb": peak_rss_bytes() / 1e9}


def part_70b() -> dict[str, float]:
    from stageplan.materialize import parameter_bytes
    from stageplan.profiling.memory import peak_rss_bytes
    from stageplan.profiling.profiler import profile_model

    t0 = time.perf_counter()
    # A batch of 8 sequences, profiled per microbatch of 1: plans default to 8 microbatches.
    wl = _llama_workload("70b", seq_len=4096, batch_size=8, dtype="bfloat16")
    print(f"  built on meta: {parameter_bytes(wl.model) / 2 / 1e9:.2f} B parameters; "
          f"{time.perf_counter() - t0:.1f} s",
          flush=True)
    prof = profile_model(wl, microbatch_size=1, device="estimate:h100-sxm")
    wall = time.perf_counter() - t0
    ESTIMATE_OUT.parent.mkdir(parents=True, exist_ok=True)
    prof.save(ESTIMATE_OUT)
    blocks = [x for x in prof.layers if ".layers." in f".{x.name}"]
    print(
        f"  wall time {wall:.1f} s (goal <= 120 s); peak RSS {peak_rss_bytes() / 1e9:.2f} GB (goal <= 4 GB)")
    print(f"  {len(blocks)} blocks, {sum(1 for x in blocks if x.measured_as)} reusing another block's "
          f"figures; {prof.meta['layers_measured']} of {len(prof)} layers estimated")
    for x in prof.layers[:2] + prof.layers[-1:]:
        print(f"  {x.name:22s} fwd {x.forward_s * 1e3:8.2f} ms  bwd {x.backward_s * 1e3:8.2f} ms  "
              f"act {x.activation_bytes / 2**30:6.2f} GiB  params {x.param_bytes / 2**30:6.2f} GiB")
    step = sum(x.forward_s + x.backward_s for x in prof.layers)
    print(f"  one microbatch forward+backward on one H100 SXM: {step:.2f} s (all 80 blocks); wrote "
          f"{ESTIMATE_OUT.relative_to(ROOT)}")
    return {"llama2_70b_s": wall, "llama2_70b_peak_rss_gb": peak_rss_bytes() / 1e9}


def part_qwen() -> dict[str, float]:
    """The command a user types, in a child process: its wall time and its peak resident set (the children's
    ru_maxrss, KiB on Linux: getrusage(2))."""
    import resource
    import tempfile

    command = [sys.executable, "-m", "stageplan", "profile", "hf", "--set", "preset=qwen2-7b", "--set",
               "seq_len=128", "--microbatch-size", "1", "--quiet", "-o"]
    print("  stageplan profile hf --set preset=qwen2-7b --set seq_len=128 --microbatch-size 1", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        subprocess.run([*command, str(Path(tmp) / "q.json")], check=True)
        wall = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    print(f"  wall time {wall:.0f} s (goal <= 900 s); peak RSS {peak / 1e9:.2f} GB (goal <= 8 GB)")
    return {"qwen2_7b_s": wall, "qwen2_7b_peak_rss_gb": peak / 1e9}


PARTS = {"7b": ("LLaMA-2-7B, seq 128, microbatch 1, fp32, layer at a time on this CPU", part_7b),
         "70b": ("LLaMA-2-70B, seq 4096, microbatch 1, bfloat16, estimate:h100-sxm", part_70b),
         "qwen2-7b": ("Qwen2-7B's shape (152k vocabulary, untied), seq 128, microbatch 1, fp32, from the CLI",
                      part_qwen)}
FIGURES = "FIGURES "  # the line a part's process ends with: its figures as JSON, for the record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=sorted(PARTS), default=None,
                        help="run one part in this process (printed, not recorded)")
    args = parser.parse_args()
    if args.part is not None:
        title, fn = PARTS[args.part]
        print(title, flush=True)
        print(FIGURES + json.dumps(fn()), flush=True)
        return
    start, t0 = results.host(), time.perf_counter()
    figures: dict[str, float | int | None] = {}
    for name in ("70b", "qwen2-7b", "7b"):  # each in a fresh process: its peak RSS is its own
        proc = subprocess.Popen([sys.executable, __file__, "--part", name], stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(FIGURES):
                figures.update(json.loads(line[len(FIGURES):]))
            else:
                print(line, end="", flush=True)
        if proc.wait() != 0:
            sys.exit(f"bench_large: part {name} failed (exit {proc.returncode}); nothing recorded")
    path = results.record({"large": figures}, start=start, wall_s=time.perf_counter() - t0)
    results.regenerate()
    print(f"recorded {path.relative_to(results.ROOT)}; regenerated {results.DOC.relative_to(results.ROOT)}")


if __name__ == "__main__":
    main()
