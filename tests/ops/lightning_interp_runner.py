"""Run the lightning-attention Triton kernels under ``TRITON_INTERPRET=1`` on saved inputs.

Used by ``test_lightning_attn_triton.py``, which writes one ``<case>.npz`` per case, runs this script in
a subprocess (the interpreter must be switched on before Triton compiles anything) and compares the
``<case>.out.npz`` results with its float64 recurrence. No math happens here.

    python lightning_interp_runner.py CASE_DIR {torch|paddle|paddle-no-torch}
"""

import glob
import os
import sys


def main(case_dir, framework):
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("set TRITON_INTERPRET=1")
    if framework == "paddle-no-torch":
        sys.modules["torch"] = None  # makes `import torch` raise, as on a Paddle-only machine
    import numpy as np

    from fastdeploy_ext.ops.lightning_attn import triton_kernels

    if framework == "torch":
        import torch

        def to_tensor(x):
            return torch.from_numpy(np.ascontiguousarray(x))

        def to_numpy(t):
            return t.numpy()

    else:
        import paddle

        def to_tensor(x):
            return paddle.to_tensor(np.ascontiguousarray(x))

        def to_numpy(t):
            return t.numpy()

    for path in sorted(glob.glob(os.path.join(case_dir, "*.in.npz"))):
        case = dict(np.load(path))
        pool = to_tensor(case["pool"])
        out = to_tensor(np.full(case["q"].shape, np.nan, dtype=np.float32))
        qkv = [to_tensor(case[n]) for n in ("q", "k", "v")]
        slopes, slots = to_tensor(case["slopes"]), to_tensor(case["slots"])
        if "cu_seqlens" in case:
            seg = int(case["segment_len"])
            triton_kernels.lightning_attn_prefill(
                *qkv,
                slopes,
                to_tensor(case["cu_seqlens"]),
                pool,
                slots,
                block_size=int(case["block_size"]),
                precision="ieee",
                segment_len=seg if seg > 0 else None,
                out=out,
            )
        else:
            triton_kernels.lightning_attn_decode(*qkv, slopes, pool, slots, out=out)
        np.savez(path.replace(".in.npz", ".out.npz"), out=to_numpy(out), pool=to_numpy(pool))
    print("torch imported:", "torch" in sys.modules and sys.modules["torch"] is not None)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
