#!/usr/bin/env bash
# The prepared GPU check (issue: foundation, "if your task is lent a GPU"): profile gpt and convnet on CUDA in
# float32 and bfloat16 at two microbatch sizes, print sum-vs-whole, and write profiles/h200/*.json.
# Run from the repository root on the GPU machine, within about 8 minutes:
#   bash benchmarks/gpu_profiles.sh [OUT_DIR]      (default profiles/h200; the device tool passes $OUT)
# Not yet run: no GPU was lent to the session that wrote it.
set -euo pipefail
out="${1:-profiles/h200}"
mkdir -p "$out"
python3 -m pip install -q -e . >/dev/null 2>&1 || true
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
