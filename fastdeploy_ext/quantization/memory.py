"""Weight bytes: measured on a loaded model (the load log) and computed from a config's shapes (the memory
planning table in docs/quantization.md)."""

from __future__ import annotations

import math

import numpy as np

BF16 = 2
FP32 = 4


def model_weight_bytes(model) -> dict:
    """Bytes this rank holds: ``quantized`` (codes and scales of quantized layers), ``full`` (everything else)."""
    out = {"quantized": 0, "full": 0}
    for _, p in model.named_parameters():
        nbytes = int(np.prod(p.shape)) * p.element_size()
        out["quantized" if hasattr(p, "quant_role") else "full"] += nbytes
    out["total"] = out["quantized"] + out["full"]
    return out


def describe_weight_bytes(model, rank: int, method) -> str:
    b = model_weight_bytes(model)
    gib = 1 << 30
    return (f"rank {rank}: weights {b['total'] / gib:.3f} GiB ({b['total']} bytes; quantization {method or 'none'}: "
            f"{b['quantized']} bytes quantized, {b['full']} bytes full precision)")


def linear_bytes(i: int, o: int, method: str | None, group_size: int = -1) -> int:
    """Bytes of one ``[i, o]`` weight with its scales as the package stores it (bf16 for unquantized);
    wint4 ``group_size`` -1 is one scale per output channel."""
    if method is None:
        return BF16 * i * o
    if method == "wint8":
        return i * o + FP32 * o
    if method == "wint4":
        groups = 1 if group_size == -1 else math.ceil(i / group_size)
        return i * o // 2 + FP32 * groups * o
    raise ValueError(f"no byte model for method {method!r}")


# (count, in, out, split) of every quantizable linear; split: "col" shards out, "row" shards in.
def minimax_m1_linears(cfg: dict) -> list[tuple]:
    h, heads, kv, d = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    inter, experts = cfg["intermediate_size"], cfg["num_local_experts"]
    types = cfg["attn_type_list"]
    n_full, n_lin = sum(1 for t in types if t == 1), sum(1 for t in types if t == 0)
    return [
        (n_lin, h, 3 * heads * d, "col"), (n_lin, h, heads * d, "col"), (n_lin, heads * d, h, "row"),
        (n_full, h, (heads + 2 * kv) * d, "col"), (n_full, heads * d, h, "row"),
        (len(types) * experts, h, 2 * inter, "col"), (len(types) * experts, inter, h, "row"),
    ]


def qwen2_linears(cfg: dict) -> list[tuple]:
    h, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d, inter, n = cfg.get("head_dim") or h // heads, cfg["intermediate_size"], cfg["num_hidden_layers"]
    return [(n, h, (heads + 2 * kv) * d, "col"), (n, heads * d, h, "row"), (n, h, 2 * inter, "col"),
            (n, inter, h, "row")]


def linear_bytes_per_rank(linears: list[tuple], method: str | None, tp: int, group_size: int = -1) -> int:
    total = 0
    for count, i, o, split in linears:
        i_r, o_r = (i, o // tp) if split == "col" else (i // tp, o)
        total += count * linear_bytes(i_r, o_r, method, group_size)
    return total


def minimax_m1_other_bytes(cfg: dict, tp: int) -> int:
    """Full-precision rest per rank: bf16 embedding, fp32 lm_head and routers, norms (vocab-parallel tables)."""
    h, v, n = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    inner = cfg["num_attention_heads"] * cfg["head_dim"]
    n_lin = sum(1 for t in cfg["attn_type_list"] if t == 0)
    return (BF16 * v // tp * h + FP32 * v // tp * h + n * FP32 * cfg["num_local_experts"] * h
            + BF16 * (2 * n * h + h + n_lin * inner // tp))


MIDASHENGLM_7B_DECODER = dict(hidden_size=3584, num_attention_heads=28, num_key_value_heads=4, head_dim=128,
                              intermediate_size=18944, num_hidden_layers=28, vocab_size=152064)
MIDASHENGLM_7B_ENCODER = dict(embed_dim=1280, depth=32, mlp_hidden=5120, patches=252, patch_params=64 * 4,
                              projector_in=1280 * 5)


def midashenglm_other_bytes(tp: int) -> int:
    """Full-precision rest per rank (bf16): embedding, fp32 lm_head, norms, qkv biases, the audio encoder (its
    linears split like the decoder's) and projector."""
    d, e = MIDASHENGLM_7B_DECODER, MIDASHENGLM_7B_ENCODER
    h, v, n = d["hidden_size"], d["vocab_size"], d["num_hidden_layers"]
    qkv_out = (d["num_attention_heads"] + 2 * d["num_key_value_heads"]) * d["head_dim"]
    decoder = BF16 * v // tp * h + FP32 * v // tp * h + BF16 * (n * (2 * h + qkv_out // tp) + h)
    c, m = e["embed_dim"], e["mlp_hidden"]
    block_linear = (3 * c * c + c * c + 2 * c * m) // tp
    block_rest = 3 * c // tp + c + m // tp + c + 4 * c
    encoder = BF16 * (e["depth"] * (block_linear + block_rest) + c * e["patch_params"] + c + c * e["patches"] + c
                      + 4 * 1 + 2 * c)
    projector = BF16 * ((e["projector_in"] * h + h * h) // tp + h // tp + h)
    return decoder + encoder + projector


def memory_table(minimax_m1_config: dict) -> str:
    """The Markdown table of docs/quantization.md: GiB per card of MiniMax-M1 and MiDashengLM-7B weights in bf16,
    wint8 and wint4 (one scale per output channel) at tp 1-8."""
    gib = 2**30
    lines = ["| model | tp | rest | bf16: linear / total | wint8: linear / total | wint4: linear / total |",
             "|---|---|---|---|---|---|"]
    models = [("MiniMax-M1", minimax_m1_linears(minimax_m1_config), lambda tp: minimax_m1_other_bytes(minimax_m1_config, tp)),
              ("MiDashengLM-7B", qwen2_linears(MIDASHENGLM_7B_DECODER), midashenglm_other_bytes)]
    for name, linears, other in models:
        for tp in (1, 2, 4, 8):
            rest = other(tp)
            cells = [f"{linear_bytes_per_rank(linears, m, tp) / gib:.2f} / "
                     f"{(linear_bytes_per_rank(linears, m, tp) + rest) / gib:.2f}" for m in (None, "wint8", "wint4")]
            lines.append(f"| {name} | {tp} | {rest / gib:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)

