"""What the compiler makes of the device sampler's kernels, on a machine without a GPU: each kernel compiled for
sm_90 (H100 / H200) by Triton's own toolchain (``ptxas``, ``nvdisasm`` and ``cuobjdump`` ship in the triton wheel),
with the registers per thread, how many programs of 128 threads that lets a multiprocessor hold (65,536 registers),
and the SASS instruction counts that decide a streaming pass's cost: global loads (``LDG``), asynchronous copies
(``LDGSTS``, a pipelined loop), exponentials and logarithms (``MUFU``), barriers, shuffles, local-memory spills.
These are static counts of the whole kernel, not timings: a loop body counts once. ``--loops`` also prints each
kernel's largest loops (a backward branch to a label and the instructions between), the streaming passes' cost per
block of BLOCK tokens, branches inside a loop included whether they run or not.

The kernels are specialised as ``sample_rows`` launches them at R=256 and vocab 200,064 (chunks of 32,768, blocks
of 1,024, 4 warps; integer arguments divisible by 16 marked so, as Triton's launcher does); ``--variant`` picks the
stats kernel's specialisation (which rows the batch holds). The rank rounds, the search, ties and draw run on chunks of
8,192 and take their rows from work lists, as ``sample_rows`` launches them.

    python benchmarks/kernel_resources.py
    python benchmarks/kernel_resources.py --variant logprobs --sass-out /tmp/sass
    python benchmarks/kernel_resources.py --variant t=1 --loops 2
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

POINTERS = dict(logits="*fp32", work="*fp32", bitmask="*i32", counts="*i32", prm="*i32", part="*fp32",
                tpieces="*fp32", cands="*i64", ccnt="*i32", lanes="*fp32", picks="*i32", stats="*fp32", state="*i64",
                hcnt="*i32", hmass="*i64", pieces="*fp32", out="*i32", gbuf="*i64", mods="*i32", entries="*i32",
                slots="*i32")
DIVISIBLE = ("stride_l", "stride_w", "stride_c", "V")  # 200,064 and the padded counts rows are multiples of 16
CONSTANTS = dict(CP=8, NB=2048, BLOCK=1024, ITERS=32, KP=8, TOPS=False, CAND=128, TB=2, NTP=128, PIECE=8192,
                 NGP=32, DRAW=True, LSE=False, KSEL=False, COUNT=False, PEN=False, MSK=False, ROOM=512,
                 NPP=32, CHUNK=32768)
LISTED = ("_rank_kernel", "_hist_kernel", "_ties_kernel", "_draw_kernel")  # on chunks of 8,192
VARIANTS = {  # the stats kernel's specialisation per kind of batch
    "greedy": dict(DRAW=False),
    "t=1": dict(),
    "logprobs": dict(LSE=True, TOPS=True),
    "top-k": dict(DRAW=False, KSEL=True, COUNT=True),
    "penalties": dict(PEN=True),
    "mask": dict(MSK=True),
}
KERNELS = ("_stats_kernel", "_rank_kernel", "_gather_kernel", "_hist_kernel", "_ties_kernel", "_draw_kernel",
           "_tops_kernel")
COUNTED = ("LDG", "LDGSTS", "STG", "ATOMG", "MUFU", "BAR", "SHFL", "STL", "LDL")


def compile_sm90(fn, constants, warps=4, maxnreg=None):
    """(cubin bytes, SASS text) of ``fn`` for sm_90 with ``constants``; other arguments int32 or POINTERS."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = fn.arg_names
    consts = {p.name: constants[p.name] for p in fn.params if p.is_constexpr}
    sig = {n: "constexpr" if n in consts else POINTERS.get(n, "i32") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names
             if sig[n].startswith("*") or n in DIVISIBLE}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()}, attrs=attrs)
    options = {"num_warps": warps, **({"maxnreg": maxnreg} if maxnreg else {})}
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    return kernel.asm["cubin"], _tool("nvdisasm", "-c", "-g", data=kernel.asm["cubin"])


def _tool(name, *args, data):
    import tempfile

    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(data)
        f.flush()
        return subprocess.run([path, *args, f.name], capture_output=True, text=True, check=True).stdout


def resources(cubin, sass):
    regs = int(re.search(r"REG:(\d+)", _tool("cuobjdump", "--dump-resource-usage", data=cubin)).group(1))
    ops = Counter(m.split(".")[0] for m in
                  re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", sass, re.M))
    return regs, ops


def loops(sass, largest):
    """The ``largest`` loops of ``sass`` by instructions: (instructions, the last line of our source before its
    backward branch, usually the ``for``, Counter of the COUNTED ones)."""
    ins, labels, found, where = [], {}, [], "?"
    for line in sass.splitlines():
        label = re.match(r"^(\.L_x_\d+):", line)
        if label:
            labels[label.group(1)] = len(ins)
        source = re.search(r'//## File "([^"]+)", line (\d+)', line)
        if source and os.sep + "triton" + os.sep not in source.group(1):  # Triton's own helpers, inlined
            where = f"{os.path.basename(source.group(1))}:{source.group(2)}"
        m = re.match(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)(.*)$", line)
        if m:
            ins.append(m.group(1).split(".")[0])
            back = re.search(r"`\((\.L_x_\d+)\)", m.group(2))
            if ins[-1] == "BRA" and back and labels.get(back.group(1), len(ins)) < len(ins):
                body = ins[labels[back.group(1)]:]
                found.append((len(body), where, Counter(op for op in body if op in COUNTED)))
    return sorted(found, key=lambda f: -f[0])[:largest]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", choices=sorted(VARIANTS), nargs="+", default=sorted(VARIANTS),
                    help="the stats kernel's specialisations to compile (default: all)")
    ap.add_argument("--block", type=int, default=1024)
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--maxnreg", type=int, help="cap the registers per thread (Triton's maxnreg option)")
    ap.add_argument("--sass-out", help="also write each kernel's SASS into this folder")
    ap.add_argument("--loops", type=int, default=0, metavar="N", help="also print each kernel's N largest loops")
    args = ap.parse_args(argv)
    from fastdeploy_ext.ops.sampling import triton_kernels as tk
    from fastdeploy_ext.ops.sampling.launcher import stats_stages

    jobs = [(f"_stats_kernel [{v}]", "_stats_kernel", VARIANTS[v]) for v in args.variant]
    jobs += [(name, name, {"CHUNK": 8192, "NPP": 32} if name in LISTED else {}) for name in KERNELS[1:]]
    print(f"{'kernel':<28} {'regs':>4} {'prog/SM':>7} " + " ".join(f"{c:>6}" for c in COUNTED), flush=True)
    for label, name, extra in jobs:
        constants = {**CONSTANTS, **extra}
        constants["STAGES"] = stats_stages(constants["PEN"], constants["MSK"])  # as sample_rows picks it
        constants.update(BLOCK=args.block, ITERS=constants["CHUNK"] // args.block)
        cubin, sass = compile_sm90(getattr(tk, name), constants, args.warps, args.maxnreg)
        regs, ops = resources(cubin, sass)
        if args.sass_out:
            os.makedirs(args.sass_out, exist_ok=True)
            with open(os.path.join(args.sass_out, re.sub(r"\W+", "_", label).strip("_") + ".sass"), "w") as f:
                f.write(sass)
        # Registers go to a warp in units of 8 per thread; an SM holds at most 64 warps.
        per_sm = min(65536 // (-(-regs // 8) * 8 * 32 * args.warps), 64 // args.warps)
        print(f"{label:<28} {regs:>4} {per_sm:>7} " + " ".join(f"{ops[c]:>6}" for c in COUNTED), flush=True)
        for size, where, counts in loops(sass, args.loops):
            print(f"  loop at {where:<24} {size:>5} instructions  "
                  + " ".join(f"{c} {counts[c]}" for c in COUNTED if counts[c]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
