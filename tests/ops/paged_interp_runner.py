"""Run the paged-attention Triton kernels under ``TRITON_INTERPRET=1`` on saved inputs.

Used by ``test_paged_attention_triton.py``, which writes one ``<case>.in.npz`` per case, runs this script in a
subprocess (the interpreter must be on before Triton compiles anything) and compares each ``<case>.out.npz`` with
the float64 reference. The output starts as NaN, so a row the kernels skip shows. No math happens here.

    python paged_interp_runner.py CASE_DIR {torch|paddle}
"""

import glob
import os
import sys


def main(case_dir, framework):
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("set TRITON_INTERPRET=1")
    import numpy as np

    from fastdeploy_ext.ops.paged_attention import DecodeConfig, PrefillConfig, paged_decode, paged_prefill

    if framework == "torch":
        import torch

        def to_tensor(x):
            return torch.from_numpy(np.ascontiguousarray(x))
    else:
        import paddle

        def to_tensor(x):
            return paddle.to_tensor(np.ascontiguousarray(x))

    for path in sorted(glob.glob(os.path.join(case_dir, "*.in.npz"))):
        c = dict(np.load(path))
        q, kc, vc = (to_tensor(c[n]) for n in ("q", "k_cache", "v_cache"))
        out = to_tensor(np.full(c["q"].shape, np.nan, np.float32))
        page, scale = int(c["page_size"]), float(c["scale"])
        if "dec_lens" in c:
            cfg = DecodeConfig(block_n=int(c["block_n"]), split_len=int(c["split_len"]) or None)
            paged_decode(q, kc, vc, to_tensor(c["dec_tables"]), to_tensor(c["dec_lens"]), scale=scale, page_size=page,
                         max_seq_len=int(c["dec_lens"].max()), out=out, config=cfg)
        if "cu" in c:
            cfg = PrefillConfig(int(c["block_m"]), int(c["block_n"]), 4, 1, bool(c["tma"]), bool(c["paired"])) \
                if int(c["block_m"]) else None
            paged_prefill(q, kc, vc, to_tensor(c["pre_tables"]), to_tensor(c["cu"]), to_tensor(c["ctx"]), scale=scale,
                          page_size=page, max_q_len=int(np.diff(c["cu"]).max()), out=out, config=cfg)
        np.savez(path.replace(".in.npz", ".out.npz"), out=np.asarray(out.numpy()))
        print("ran", os.path.basename(path), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
