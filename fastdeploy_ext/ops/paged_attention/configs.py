"""Launch configurations of the paged-attention kernels and the rules that pick them, without Triton (the planner
sizes the decode workspace from here)."""

from dataclasses import dataclass

__all__ = ["DecodeConfig", "PrefillConfig", "decode_splits", "decode_workspace_bytes", "default_decode_config",
           "default_prefill_config"]


@dataclass(frozen=True)
class DecodeConfig:
    """``block_n`` keys per step; the context is split into pieces of ``split_len`` tokens (a multiple of
    ``block_n``; default: :func:`decode_splits`), each its own program, when one program per (sequence, KV head)
    would leave the GPU idle. ``programs_per_sm``/``min_split``: the default's aim and its shortest piece."""

    block_n: int = 128
    num_warps: int = 4
    num_stages: int = 2
    split_len: int | None = None
    programs_per_sm: int = 2
    min_split: int = 256


def default_decode_config(batch, num_kv_heads, num_sms):
    """As measured fastest on an H200 (docs/ops/paged_attention.md): 128-key tiles, two programs per SM (their
    two-stage K/V buffers fill the shared memory), the context split to fill that one wave; where the sequences'
    KV heads alone give 4 programs per SM, 64-key tiles on 3 stages (four resident per SM), unsplit."""
    if num_sms and batch * num_kv_heads >= 4 * num_sms:
        return DecodeConfig(64, 4, 3, None, 4)
    return DecodeConfig()


@dataclass(frozen=True)
class PrefillConfig:
    """``block_m`` query rows of one head by ``block_n`` keys per step; ``tma``: the unmasked key tiles come by the
    tensor-memory accelerator (Hopper and later) where a tile lies inside one page (``page_size % block_n == 0``),
    the head dim is a
    power of two and the cache has fewer than 2**31 rows over all KV heads (otherwise plain loads); ``paired``: each
    program takes query tiles ``i`` and ``T - 1 - i`` of the longest chunk's ``T`` (equal causal work per program)."""

    block_m: int = 128
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3
    tma: bool = True
    paired: bool = False


def default_prefill_config(dtype_name, head_dim, interpreter, programs_128=None, num_sms=None, ctx_len=None,
                           q_len=None):
    """As measured fastest on an H200 at MiniMax-M1's and Qwen2-7B's shapes (docs/ops/paged_attention.md): 128 x 64
    tiles on 4 warps, 3 stages, keys and values by TMA. Where 128-row tiles give fewer than 4 programs per SM and the
    chunk's own causal triangle outweighs its context, the programs' unequal work would leave SMs idle at the end:
    tiles are paired first-with-last while the pairs still give every SM one, else 64-row tiles."""
    if interpreter:
        return PrefillConfig(32, 32, 4, 1, False)
    if dtype_name == "float32" or head_dim > 128:
        return PrefillConfig(64, 32, 4, 2, False)
    if programs_128 is not None and num_sms and programs_128 < 4 * num_sms and (ctx_len or 0) <= (q_len or 0):
        if programs_128 >= 2 * num_sms:
            return PrefillConfig(paired=True)
        return PrefillConfig(64, 64, 4, 3)
    return PrefillConfig()


def decode_splits(batch, num_kv_heads, max_len, num_sms, config=DecodeConfig()):
    """``(split_len, num_splits)`` for a decode batch whose longest context is ``max_len`` tokens: one piece per
    (sequence, KV head) when they already give ``programs_per_sm`` programs per SM, else the context cut into
    as many pieces (of at least ``min_split`` tokens) as keep the programs within that one wave. ``num_sms`` None
    (the CPU interpreter): one piece unless ``config.split_len`` says otherwise."""
    bn = config.block_n
    max_len = max(int(max_len), 1)
    if config.split_len is not None:
        split_len = config.split_len
    elif num_sms is None:
        split_len = _cdiv(max_len, bn) * bn
    else:
        # At most one wave of programs_per_sm programs per SM: 1.5 waves measured 1.2x slower than one.
        splits = max(1, config.programs_per_sm * num_sms // max(batch * num_kv_heads, 1))
        split_len = max(_cdiv(_cdiv(max_len, splits), bn) * bn, _cdiv(config.min_split, bn) * bn)
    return split_len, _cdiv(max_len, split_len)


def decode_workspace_bytes(batch, num_heads, num_kv_heads, head_dim, max_len, num_sms, config=None):
    """Bytes of float32 partial outputs and log-sum-exps a decode of this size allocates (0 with one split)."""
    config = config or default_decode_config(batch, num_kv_heads, num_sms)
    _, splits = decode_splits(batch, num_kv_heads, max_len, num_sms, config)
    return 0 if splits == 1 else batch * num_heads * splits * (_next_pow2(head_dim) + 1) * 4


def _cdiv(a, b):
    return -(-a // b)


def _next_pow2(n):
    return 1 << (max(1, n) - 1).bit_length()
