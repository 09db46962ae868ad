"""``keep_freed_memory`` (``ops/cpu_allocator.py``): after it, a freed 40 MB block is reused by the next allocation
instead of coming back from the kernel as fresh pages. Each case runs in its own interpreter: the setting is
process-wide and cannot be undone. Page faults are counted, not timed."""

import json
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="mallopt is glibc's")

ROUNDS, BLOCK = 20, 40 << 20  # above glibc's largest adaptive mmap threshold (32 MB)
# Faults a fresh block takes at least: 20 where the kernel backs it with 2 MB transparent huge pages, 10240 with
# 4 kB pages.
FRESH = BLOCK // (2 << 20)

CODE = f"""
import json, resource
import numpy as np
from fastdeploy_ext.ops.cpu_allocator import keep_freed_memory
state = keep_freed_memory()
faults = []
for _ in range({ROUNDS}):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    a = np.empty({BLOCK} // 4, np.float32)
    a.fill(1.0)  # touch every page
    del a
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps(dict(state=state, faults=faults)))
"""


def run(env_value):
    env = None
    if env_value is not None:
        import os

        env = dict(os.environ, FDEXT_KEEP_FREED_MEMORY=env_value)
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120, env=env,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_freed_blocks_are_reused_without_page_faults():
    got = run(None)
    assert got["state"] == "on"
    # The first block's pages come from the kernel once; every later round reuses them.
    assert got["faults"][0] >= FRESH, got["faults"]
    assert sum(got["faults"][1:]) < FRESH, got["faults"]


def test_opt_out_keeps_glibc_defaults_which_fault_every_round():
    got = run("0")
    assert got["state"].startswith("off")
    # Without the setting each 40 MB block is its own mmap: every round faults its pages in again (this is what
    # the setting removes, so the first test can fail).
    assert all(f >= FRESH for f in got["faults"]), got["faults"]
