"""Run ``fused_moe`` under ``TRITON_INTERPRET=1`` on saved inputs (for ``test_fused_moe_triton.py``).

Each ``<case>.in.npz`` holds float32 arrays (bf16 cases hold values exactly representable in bf16, converted
here), the case's launch config and how many times to run; every output starts as a NaN-filled buffer. The
test compares ``<case>.out.npz`` with the float64 reference. No math happens here.

    python fused_moe_interp_runner.py CASE_DIR {torch|paddle|paddle-no-torch}
"""

import glob
import json
import os
import sys


def main(case_dir, framework):
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("set TRITON_INTERPRET=1")
    if framework == "paddle-no-torch":
        sys.modules["torch"] = None  # makes `import torch` raise, as on a Paddle-only machine
    import numpy as np

    from fastdeploy_ext.ops.fused_moe import launcher

    if framework == "torch":
        import torch

        def tensor(a, dtype):
            t = torch.from_numpy(np.ascontiguousarray(a))
            return t.to(getattr(torch, dtype)) if dtype != str(a.dtype) else t

        def host(t):
            return t.float().numpy()

    else:
        import paddle

        def tensor(a, dtype):
            t = paddle.to_tensor(np.ascontiguousarray(a))
            return t.astype(dtype) if dtype != str(a.dtype) else t

        def host(t):
            return t.astype("float32").numpy()

    for path in sorted(glob.glob(os.path.join(case_dir, "*.in.npz"))):
        case = dict(np.load(path))
        meta = json.loads(str(case.pop("meta")))
        dtype = meta["dtype"]
        wdtype = "int8" if "up_gate_scale" in case else dtype
        args = [tensor(case["x"], dtype), tensor(case["up_gate_w"], wdtype), tensor(case["down_w"], wdtype),
                tensor(case["topk_ids"], str(case["topk_ids"].dtype)), tensor(case["topk_weights"], "float32")]
        scales = {n: tensor(case[n], "float32") for n in ("up_gate_scale", "down_scale") if n in case}
        cfg = None
        if meta.get("config"):
            c = meta["config"]
            cfg = launcher.MoEConfig(launcher.GemmConfig(**c["up"]), launcher.GemmConfig(**c["down"]),
                                     align_block=c["align_block"], combine_block=c["combine_block"])
        results = {}
        for run in range(meta["runs"]):
            out = tensor(np.full(case["x"].shape, np.nan, np.float32), meta.get("out_dtype", dtype))
            launcher.fused_moe(*args, **scales, out=out, config=cfg)
            results[f"out{run}"] = host(out)
        np.savez(path.replace(".in.npz", ".out.npz"), **results)
    print("torch imported:", "torch" in sys.modules and sys.modules["torch"] is not None)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
