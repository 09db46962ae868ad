"""One prefill launch (H = 64, N = 32768, default config; float32 unless ``bf16``) for Nsight Compute on the H200.

    ncu --clock-control none --kernel-name regex:_output_kernel --launch-skip 1 --launch-count 1 \\
        --section WarpStateStats --section SourceCounters \\
        python3 benchmarks/profile_lightning_prefill.py [triton] [bf16]

``triton`` forces the portable Triton output kernel instead of the default (Gluon on Hopper); ``bf16`` takes bf16
inputs.
"""

import sys

import torch

sys.path.insert(0, ".")
from benchmarks.bench_lightning_attn import prefill_inputs  # noqa: E402
from fastdeploy_ext.ops.lightning_attn import triton_kernels as tk  # noqa: E402

x = prefill_inputs(64, 32768, torch.bfloat16 if "bf16" in sys.argv[1:] else torch.float32)
cfg = tk.LaunchConfig(32, 4, 1) if "triton" in sys.argv[1:] else None
for _ in range(2):
    tk.lightning_attn_prefill(x["q"], x["k"], x["v"], x["slopes"], x["cu"], x["pool"], x["slots"], launch_config=cfg,
                              out=x["out"])
torch.cuda.synchronize()
