#!/usr/bin/env bash
# The GPU check, for a machine with a CUDA GPU (run from the repository root on that machine; it takes about
# 8 minutes):
#   bash benchmarks/gpu_profiles.sh [OUT_DIR]      (default profiles/h200)
# 1. gpt and convnet profiled on CUDA in float32 and bfloat16 at two microbatch sizes (sum of layers vs whole);
# 2. LLaMA-2-7B (bf16, sequence 2048, microbatch 1) profiled on CUDA one layer at a time, and estimated for the
#    H200 from its shape alone; the per-layer estimate / measured ratios are printed (the estimate's accuracy).
# Not yet run on a GPU: its figures are not in the repository.
set -euo pipefail
out="${1:-profiles/h200}"
mkdir -p "$out"
python3 -m pip install -q -e '.[hf]' >/dev/null 2>&1 || true
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(0))"
for model in gpt convnet; do
  for dtype in float32 bfloat16; do
    for mb in 2 4; do
      f="$out/${model}-${dtype}-mb${mb}.json"
      timeout 120 python3 -m stageplan profile "$model" --device cuda --dtype "$dtype" --microbatch-size "$mb" --quiet -o "$f"
      python3 - "$f" <<'PY'
import sys
from stageplan import Profile
p = Profile.load(sys.argv[1])
print(f"{sys.argv[1]}: {len(p)} layers, sum of layers / whole = {p.sum_vs_whole:.3f}, whole {p.meta['whole_model_s'] * 1e3:.3f} ms")
PY
    done
  done
done
llama=(hf --set preset=llama2-7b --set seq_len=2048 --set batch_size=1 --microbatch-size 1 --dtype bfloat16)
timeout 300 python3 -m stageplan profile "${llama[@]}" --device cuda --streaming --quiet -o "$out/llama2-7b-bf16-s2048.json"
timeout 120 python3 -m stageplan profile "${llama[@]}" --device estimate:h200 --quiet -o "$out/llama2-7b-bf16-s2048-estimate.json"
python3 - "$out/llama2-7b-bf16-s2048.json" "$out/llama2-7b-bf16-s2048-estimate.json" <<'PY'
import sys
from stageplan import Profile
measured, estimate = Profile.load(sys.argv[1]), Profile.load(sys.argv[2])
for m, e in zip(measured.layers, estimate.layers):
    if m.measured_as is None:
        print(f"{m.name:>24}: estimate / measured  forward {e.forward_s / m.forward_s:.2f}  backward {e.backward_s / m.backward_s:.2f}"
              f"  saved bytes {e.activation_bytes / max(m.activation_bytes, 1):.3f}")
PY
