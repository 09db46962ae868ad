"""``paged_decode`` and ``paged_prefill``: the Triton kernels on torch or Paddle tensors (README.md has the math and
the layout).

torch and Paddle tensors launch through ``fastdeploy_ext/ops/launch.py`` (for Paddle: the compat layer on a GPU,
zero-copy torch views or the host-tensor interpreter patch on the CPU). Imports neither framework at import time. Nothing here reads a device tensor back: the host values that size a launch (the
longest context, the longest chunk) come from the caller or from shapes.
"""

from fastdeploy_ext.ops import launch
from fastdeploy_ext.ops.launch import dtype_name as _dtype_name
from fastdeploy_ext.ops.paged_attention import triton_kernels as tk
from fastdeploy_ext.ops.paged_attention.configs import (DecodeConfig, PrefillConfig, _cdiv, _next_pow2,
                                                        decode_splits, decode_workspace_bytes, default_decode_config,
                                                        default_prefill_config)

__all__ = ["DecodeConfig", "PrefillConfig", "decode_splits", "decode_workspace_bytes", "default_decode_config",
           "default_prefill_config", "paged_decode", "paged_prefill"]

_FLOAT_DTYPES = ("float32", "bfloat16", "float16")
_INDEX_DTYPES = ("int32", "int64")
_MAX_HEAD_DIM = 256
_MAX_GRID_YZ = 65535


def paged_decode(q, k_cache, v_cache, block_tables, seq_lens, *, scale, page_size, max_seq_len=None, out=None,
                 config=None):
    """``out[b, h] = softmax(scale * q[b, h] K_b^T) V_b`` over the ``seq_lens[b]`` tokens of sequence ``b`` (the
    current one included, already written to the cache); a length of 0 gives zeros.

    ``q`` ``[R, Hq, D]`` float32, bfloat16 or float16 with ``R >= B`` (rows ``[0, B)`` are the decodes: a step's
    query rows, decodes first, go to :func:`paged_decode` and :func:`paged_prefill` as one tensor);
    ``k_cache``/``v_cache`` ``[Hkv, num_pages * page_size, D]`` of q's dtype (``Hq`` a multiple of ``Hkv``);
    ``block_tables`` ``[B, max_pages]`` and ``seq_lens`` ``[B]`` int32/int64: token ``p`` of sequence ``b`` is cache
    row ``block_tables[b, p // page_size] * page_size + p % page_size``. All contiguous on one CUDA device (or the
    CPU under ``TRITON_INTERPRET=1``), all torch or all Paddle. ``max_seq_len``: the longest ``seq_lens`` entry as
    a host int (sizes the split; default ``max_pages * page_size``: nothing is read back from the device). ``out``
    (q's shape and dtype): rows ``[0, B)`` are overwritten, others left as they are; returned."""
    ops = launch.ops_for(q, "q")
    rows, num_heads, head_dim, num_kv_heads = _check_q_cache(ops, q, k_cache, v_cache, page_size, 3)
    launch.check_tensor(ops, seq_lens, "seq_lens", q, "q")
    _check_index_vector(ops, seq_lens, "seq_lens", None, q)
    batch = int(seq_lens.shape[0])
    if batch > rows:
        raise ValueError(f"seq_lens describes {batch} decodes but q has {rows} rows")
    max_pages = _check_table(ops, block_tables, batch, q)
    bound = max_pages * page_size
    max_len = bound if max_seq_len is None else int(max_seq_len)
    if max_len > bound:
        raise ValueError(f"max_seq_len {max_len} exceeds block_tables' {max_pages} pages x {page_size} tokens")
    out = _check_out(ops, out, q)
    if batch == 0:
        return out
    interp = launch.interpreter_enabled()
    num_sms = None if interp else ops.num_sms(q)
    cfg = config or default_decode_config(batch, num_kv_heads, num_sms)
    split_len, num_splits = decode_splits(batch, num_kv_heads, max_len, num_sms, cfg)
    if split_len % cfg.block_n:
        raise ValueError(f"config.split_len {split_len} must be a multiple of block_n {cfg.block_n}")
    if num_kv_heads > _MAX_GRID_YZ or num_splits > _MAX_GRID_YZ:
        raise ValueError(f"{num_kv_heads} KV heads x {num_splits} splits exceed the grid's {_MAX_GRID_YZ}")
    group = num_heads // num_kv_heads
    d_pad = _next_pow2(head_dim)
    split = num_splits > 1
    # The reduce launches while the decode kernel runs and waits for it (programmatic dependent launch, Hopper).
    pdl = split and not interp and (ops.capability(q) or (0, 0)) >= (9, 0)
    part_o = ops.empty([batch, num_heads, num_splits, d_pad], "float32", q) if split else out
    part_lse = ops.empty([batch, num_heads, num_splits], "float32", q) if split else out
    ops.launch(tk._decode_kernel, (batch, num_kv_heads, num_splits),
               [q, k_cache, v_cache, out, part_o, part_lse, block_tables, seq_lens,
                _s(q, 0), _s(q, 1), _s(k_cache, 0), _s(k_cache, 1), _s(v_cache, 0), _s(v_cache, 1), _s(out, 0),
                _s(out, 1), _s(block_tables, 0), num_heads, split_len, num_splits, float(scale) * tk.LOG2E],
               GROUP=group, G_PAD=max(16, _next_pow2(group)), PAGE=page_size, BLOCK_N=cfg.block_n, D=head_dim,
               D_PAD=d_pad, SPLIT=split, PAGE_TILES=page_size % cfg.block_n == 0, PRECISION=_precision(q, interp),
               PDL=pdl, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if split:
        ops.launch(tk._reduce_kernel, (batch, num_heads),
                   [part_o, part_lse, out, seq_lens, _s(out, 0), _s(out, 1), num_heads, split_len, num_splits],
                   D=head_dim, D_PAD=d_pad, S_BLOCK=min(64, max(16, _next_pow2(num_splits))), PDL=pdl, num_warps=4,
                   **(dict(launch_pdl=True) if pdl else {}))
    return out


def paged_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, ctx_lens, *, scale, page_size, max_q_len=None,
                  max_ctx_len=None, out=None, config=None):
    """Varlen chunks attending to their cached context and to themselves, causally, bottom-right aligned: row ``i``
    of chunk ``b`` (rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` of ``q``) is position ``ctx_lens[b] + i`` and sees
    positions ``0 .. ctx_lens[b] + i`` of its sequence, all read through ``block_tables[b]`` (the chunk's own keys
    and values already written to the cache). No mask tensor: prefix-cache hits and chunked prefill are chunks
    after a context; a batch may mix them with fresh prompts (``ctx_lens`` 0).

    ``q`` ``[T, Hq, D]``, caches and ``block_tables`` as for :func:`paged_decode`; ``cu_seqlens_q`` ``[B + 1]`` and
    ``ctx_lens`` ``[B]`` int32/int64. ``max_q_len``: the longest chunk as a host int (default ``T``);
    ``max_ctx_len``: the longest context as a host int, if known (only picks the default tiles). ``out``
    ``[T, Hq, D]`` of q's dtype: rows inside the chunks are overwritten, others left as they are."""
    ops = launch.ops_for(q, "q")
    total, num_heads, head_dim, num_kv_heads = _check_q_cache(ops, q, k_cache, v_cache, page_size, 3)
    launch.check_tensor(ops, cu_seqlens_q, "cu_seqlens_q", q, "q")
    if len(cu_seqlens_q.shape) != 1 or cu_seqlens_q.shape[0] < 1 or _dtype_name(cu_seqlens_q) not in _INDEX_DTYPES:
        raise ValueError(f"cu_seqlens_q must be int32/int64 [B + 1], got {_dtype_name(cu_seqlens_q)} "
                         f"{list(cu_seqlens_q.shape)}")
    batch = int(cu_seqlens_q.shape[0]) - 1
    _check_table(ops, block_tables, batch, q)
    _check_index_vector(ops, ctx_lens, "ctx_lens", batch, q)
    out = _check_out(ops, out, q)
    longest = total if max_q_len is None else int(max_q_len)
    if longest > total:
        raise ValueError(f"max_q_len {longest} exceeds q's {total} rows")
    if batch == 0 or longest == 0:
        return out
    interp = launch.interpreter_enabled()
    cfg = config or default_prefill_config(_dtype_name(q), head_dim, interp, _cdiv(longest, 128) * num_heads * batch,
                                           None if interp else ops.num_sms(q), max_ctx_len, longest)
    if batch > _MAX_GRID_YZ or num_heads > _MAX_GRID_YZ:
        raise ValueError(f"{batch} chunks x {num_heads} heads exceed the grid's {_MAX_GRID_YZ}")
    tiles = _cdiv(longest, cfg.block_m)
    programs = _cdiv(tiles, 2) if cfg.paired else tiles
    page_tiles = page_size % cfg.block_n == 0
    # TMA (Hopper and later; the interpreter emulates it): rows of a power-of-two width, int32 row coordinates over
    # the [Hkv * rows, D] view.
    tma = (cfg.tma and page_tiles and (interp or (ops.capability(q) or (0, 0)) >= (9, 0))
           and head_dim == _next_pow2(head_dim) and head_dim * q.element_size() >= 16
           and int(k_cache.shape[0]) * int(k_cache.shape[1]) < 2**31)
    k_desc, v_desc = (_row_desc(ops, c, cfg.block_n) for c in (k_cache, v_cache)) if tma else (k_cache, v_cache)
    ops.launch(tk._prefill_kernel, (programs, num_heads, batch),
               [q, k_cache, v_cache, k_desc, v_desc, out, block_tables, cu_seqlens_q, ctx_lens,
                _s(q, 0), _s(q, 1), _s(k_cache, 0), _s(k_cache, 1), _s(v_cache, 0), _s(v_cache, 1), _s(out, 0),
                _s(out, 1), _s(block_tables, 0), tiles, float(scale) * tk.LOG2E],
               GROUP=num_heads // num_kv_heads, PAGE=page_size, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
               D=head_dim, D_PAD=_next_pow2(head_dim), PAGE_TILES=page_tiles, USE_TMA=tma, PAIRED=cfg.paired,
               PRECISION=_precision(q, interp), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


def _row_desc(ops, cache, block_n):
    """TMA descriptor over a cache viewed as ``[Hkv * rows, D]``, one ``[block_n, D]`` box per load."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    rows = int(cache.shape[0]) * int(cache.shape[1])
    dim = int(cache.shape[2])
    return TensorDescriptor(ops.desc_base(cache), [rows, dim], [dim, 1], [block_n, dim])


def _precision(q, interp):
    # float32 operands stay IEEE (the interpreter's NumPy products are anyway); 16-bit ones ignore it.
    return "ieee" if interp or _dtype_name(q) == "float32" else "tf32"


def _check_q_cache(ops, q, k_cache, v_cache, page_size, q_rank):
    launch.check_device(ops, q, "q")
    for t, name in ((q, "q"), (k_cache, "k_cache"), (v_cache, "v_cache")):
        launch.check_tensor(ops, t, name, q, "q")
    if len(q.shape) != q_rank or _dtype_name(q) not in _FLOAT_DTYPES:
        raise ValueError(f"q must be float32, bfloat16 or float16 [tokens, Hq, D], got {_dtype_name(q)} "
                         f"{list(q.shape)}")
    rows, num_heads, head_dim = (int(s) for s in q.shape)
    if not 0 < head_dim <= _MAX_HEAD_DIM:
        raise ValueError(f"head dim D={head_dim} must be in [1, {_MAX_HEAD_DIM}]")
    if len(k_cache.shape) != 3 or int(k_cache.shape[2]) != head_dim:
        raise ValueError(f"k_cache must be [Hkv, num_pages * page_size, {head_dim}], got {list(k_cache.shape)}")
    if list(v_cache.shape) != list(k_cache.shape):
        raise ValueError(f"v_cache must have k_cache's shape {list(k_cache.shape)}, got {list(v_cache.shape)}")
    for t, name in ((k_cache, "k_cache"), (v_cache, "v_cache")):
        if _dtype_name(t) != _dtype_name(q):
            raise ValueError(f"{name} must have q's dtype {_dtype_name(q)}, got {_dtype_name(t)}")
    num_kv_heads = int(k_cache.shape[0])
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"q's {num_heads} heads must be a multiple of the caches' {num_kv_heads} KV heads")
    if int(page_size) < 1 or int(k_cache.shape[1]) % int(page_size):
        raise ValueError(f"page_size {page_size} must be >= 1 and divide the caches' {int(k_cache.shape[1])} rows")
    return rows, num_heads, head_dim, num_kv_heads


def _check_table(ops, block_tables, batch, like):
    launch.check_tensor(ops, block_tables, "block_tables", like, "q")
    if len(block_tables.shape) != 2 or int(block_tables.shape[0]) != batch or \
            _dtype_name(block_tables) not in _INDEX_DTYPES:
        raise ValueError(f"block_tables must be int32/int64 [{batch}, max_pages], got {_dtype_name(block_tables)} "
                         f"{list(block_tables.shape)}")
    return int(block_tables.shape[1])


def _check_index_vector(ops, t, name, length, like):
    launch.check_tensor(ops, t, name, like, "q")
    if len(t.shape) != 1 or (length is not None and int(t.shape[0]) != length) or \
            _dtype_name(t) not in _INDEX_DTYPES:
        raise ValueError(f"{name} must be int32/int64 [{'B' if length is None else length}], got {_dtype_name(t)} "
                         f"{list(t.shape)}")


def _check_out(ops, out, q):
    if out is None:
        return ops.empty(list(q.shape), _dtype_name(q), q)
    launch.check_tensor(ops, out, "out", q, "q")
    if list(out.shape) != list(q.shape) or _dtype_name(out) != _dtype_name(q):
        raise ValueError(f"out must be {_dtype_name(q)} {list(q.shape)}, got {_dtype_name(out)} {list(out.shape)}")
    return out


def _s(t, dim):
    """Element stride of ``dim`` of a contiguous tensor (checked), from its shape alone: torch and Paddle spell
    strides differently."""
    stride = 1
    for size in t.shape[dim + 1:]:
        stride *= int(size)
    return stride
