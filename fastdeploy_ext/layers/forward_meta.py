"""Per-step inputs of a model forward; typed fields only (no ``__getattr__`` fallbacks)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import paddle


@dataclass
class ForwardMeta:
    """One padding-free step. Sequences are ordered decode-first; ``seq_lens_*`` and ``block_tables``
    are host arrays (index math happens once per step, not per layer).

    - ``ids_remove_padding`` ``[T]`` int64 and ``position_ids`` ``[T]`` int64
    - ``seq_lens_this_time`` ``[B]``: tokens of each sequence in this step
    - ``seq_lens_encoder`` ``[B]``: equal to ``seq_lens_this_time`` for prefill chunks, 0 for decodes
    - ``seq_lens_decoder`` ``[B]``: tokens already cached (0 ⇒ the sequence starts here)
    - ``cu_seqlens_q`` ``[B+1]``; ``block_tables`` ``[B, max_blocks]``
    - ``caches``: ``(k_cache, v_cache)`` per attention layer (compact index)
    - ``state_pool``: per recurrent layer (ordinal among those layers) a ``[slots, *state_shape]``
      tensor updated in place; ``slot_ids`` ``[B]`` int64, each sequence's slot (runner-owned)
    - ``output_rows``: when set (only for a model with ``selects_output_rows``), the ascending token
      rows whose hidden states the caller needs; the model returns ``[len(output_rows), hidden]``
    - ``attn_metadata`` / ``linear_attn_metadata``: filled once per step by the runner's
      ``AttentionBackend.init_attention_metadata`` (layers/backend.py)
    """

    ids_remove_padding: paddle.Tensor
    position_ids: paddle.Tensor
    seq_lens_this_time: np.ndarray
    seq_lens_encoder: np.ndarray
    seq_lens_decoder: np.ndarray
    cu_seqlens_q: np.ndarray
    block_tables: np.ndarray
    caches: list
    num_decode: int
    state_pool: Any = None
    slot_ids: Any = None
    output_rows: np.ndarray | None = None
    attn_metadata: Any = None
    linear_attn_metadata: Any = None
    extra: dict = field(default_factory=dict)
