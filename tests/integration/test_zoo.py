"""LLaMA-2-70B builds on meta in seconds under 1 GB, in a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from unit.test_zoo import PRESET_PARAMETERS


def test_llama2_70b_builds_on_meta_in_seconds_under_1_gb() -> None:
    script = textwrap.dedent("""
        import json, resource, time
        from stageplan.zoo import hf
        hf(preset="gpt2", meta=True)  # imports and first-use costs, outside the timing
        start = time.perf_counter()
        wl = hf(preset="llama2-70b", meta=True, seq_len=128, batch_size=1)
        seconds = time.perf_counter() - start
        count = sum(p.numel() for p in wl.model.parameters())
        # this process's own peak (VmHWM): ru_maxrss keeps the forking pytest process's peak across exec
        rss = int(next(ln for ln in open('/proc/self/status') if ln.startswith('VmHWM')).split()[1]) * 1024
        print(json.dumps({"seconds": seconds, "count": count, "rss_bytes": rss}))
    """)
    root = Path(__file__).parents[2]
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=root,
                          timeout=120,
                          env={"PYTHONPATH": str(root), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["count"] == PRESET_PARAMETERS["llama2-70b"]
    assert result["seconds"] < 5.0
    assert result["rss_bytes"] < 1e9  # peak of the whole process, torch and transformers included
