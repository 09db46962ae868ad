"""tests/ops/test_sampling.py in its own processes with ``TRITON_INTERPRET=1``: the interpreter has to be on before
Triton decorates any kernel (a kernel module imported earlier in the suite without it breaks the launch), and the
setting must not leak into the other tests of this process."""

import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.timeout(540)  # the subprocess's own bound is 480 s


# Six parts, each in its own process within the bound (the interpreter runs each (row, chunk) program in Python).
@pytest.mark.parametrize("select", ["exact_distribution_searched",
                                    "exact_distribution and not searched and not kernel_frequencies",
                                    "kernel_frequencies", "without_the_rank_pass", "top_k_rows or top_k_gather",
                                    "not exact_distribution and not kernel_frequencies and not without_the_rank_pass "
                                    "and not top_k_rows and not top_k_gather"],
                         ids=["searched cases", "other cases", "kernel frequencies", "first candidates", "top-k gather",
                              "the rest"])
def test_sampling_kernels_under_the_interpreter(select):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(["timeout", "480", sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "--timeout=460", "-k", select, "tests/ops/test_sampling.py"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=500)
    tail = proc.stdout[-4000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    summary = proc.stdout.strip().splitlines()[-1]
    assert re.search(r"\d+ passed", summary) and "skipped" not in summary and "failed" not in summary, tail
