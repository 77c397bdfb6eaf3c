"""An estimate of a 70B block in a fresh interpreter stays under 1 GB of RSS."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_llama70b_block_in_a_fresh_process_stays_under_1gb_rss() -> None:
    pytest.importorskip("transformers")
    code = textwrap.dedent("""
        import resource, sys
        sys.path[:0] = sys.argv[1:3]
        import test_estimate as t
        e = t._llama70b("flash")
        assert e.activation_bytes == t.LLAMA70B_FLASH_SAVED
        # VmHWM: ru_maxrss keeps the parent's peak across exec
        hwm = next(ln for ln in open('/proc/self/status') if ln.startswith('VmHWM'))
        print(int(hwm.split()[1]) * 1024)
    """)
    out = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parents[1] / "unit"), str(ROOT)],
                         check=True, capture_output=True, text=True, cwd=ROOT).stdout
    assert int(out.split()[-1]) < 1e9
