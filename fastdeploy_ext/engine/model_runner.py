"""Model runner: owns every cache tensor, turns a scheduled step into a ``ForwardMeta``, runs the
model and returns the fp32 logits rows the sampler needs."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import paddle

from fastdeploy_ext.engine.scheduler import ScheduledSeq
from fastdeploy_ext.layers.attention import build_attention_metadata
from fastdeploy_ext.layers.forward_meta import ForwardMeta


@dataclass
class StepLogits:
    """Per scheduled sequence (in the caller's order): the logits row to sample from (or None) and
    the logits rows for prompt positions ``[first_pos, first_pos + n)`` (or None)."""

    sample: list
    prompt: list


class ModelRunner:
    def __init__(self, fd_config, model, num_kv_blocks: int, num_state_slots: int):
        self.fd_config = fd_config
        self.model = model
        self.block_size = fd_config.cache_config.block_size
        self.num_kv_blocks = num_kv_blocks
        rows = num_kv_blocks * self.block_size
        dtype = fd_config.load_config.dtype
        self.caches = [
            ([paddle.zeros([rows, s.head_dim], dtype) for _ in range(s.num_kv_heads)],
             [paddle.zeros([rows, s.head_dim], dtype) for _ in range(s.num_kv_heads)])
            for s in model.kv_cache_spec()
        ]
        spec = model.state_cache_spec()
        self.state_pool = None
        if spec is not None:
            # One [slots, *shape] tensor per recurrent layer (ops update a layer's pool in place).
            # Recurrent state is fp32 whatever the model dtype (bf16 state drifts: minimax_m1.md §6).
            self.state_pool = [paddle.zeros([num_state_slots, *spec.shape], spec.dtype) for _ in range(spec.num_layers)]

    def kv_cache_bytes(self) -> int:
        return sum(int(t.numel()) * t.element_size() * 2 for k, _ in self.caches for t in k)

    def state_pool_bytes(self) -> int:
        return sum(int(p.numel()) * p.element_size() for p in self.state_pool or [])

    def copy_state(self, src_slot: int, dst_slot: int) -> None:
        for pool in self.state_pool or []:
            pool[dst_slot] = pool[src_slot]

    @paddle.no_grad()
    def execute(self, seqs: list[ScheduledSeq]) -> StepLogits:
        # Decodes (one new token) first, then multi-token prefill chunks: attention batches the former.
        order = sorted(range(len(seqs)), key=lambda i: seqs[i].num_new_tokens > 1)
        ordered = [seqs[i] for i in order]
        num_decode = sum(1 for s in ordered if s.num_new_tokens == 1)

        ids, positions = [], []
        lens = np.array([s.num_new_tokens for s in ordered], np.int64)
        starts = np.array([s.start for s in ordered], np.int64)
        max_blocks = max(len(s.request.block_ids) for s in ordered)
        block_tables = np.zeros([len(ordered), max_blocks], np.int64)
        for b, s in enumerate(ordered):
            toks = s.request.all_token_ids
            ids.extend(toks[s.start:s.start + s.num_new_tokens])
            positions.extend(range(s.start, s.start + s.num_new_tokens))
            block_tables[b, : len(s.request.block_ids)] = s.request.block_ids
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)

        slot_ids = None
        if self.state_pool is not None:
            slot_ids = np.array([s.request.state_slot for s in ordered], np.int64)
            fresh = [s.request.state_slot for s in ordered if s.start == 0]
            if fresh:
                # A sequence starting at position 0 (new, or recomputing after preemption) starts from zero state.
                for pool in self.state_pool:
                    pool[paddle.to_tensor(fresh)] = 0.0

        meta = ForwardMeta(
            ids_remove_padding=paddle.to_tensor(np.asarray(ids, np.int64)),
            position_ids=paddle.to_tensor(np.asarray(positions, np.int64)),
            seq_lens_this_time=lens,
            seq_lens_encoder=np.where(np.arange(len(ordered)) >= num_decode, lens, 0),
            seq_lens_decoder=starts,
            cu_seqlens_q=cu,
            block_tables=block_tables,
            caches=self.caches,
            attn_metadata=build_attention_metadata(lens, starts, block_tables, self.block_size, num_decode)
            if self.caches else None,
            num_decode=num_decode,
            state_pool=self.state_pool,
            slot_ids=slot_ids,
            extra={"requests": [s.request for s in ordered]},
        )
        hidden = self.model(meta.ids_remove_padding, meta)

        rows, sample_at, prompt_at = [], {}, {}
        for b, s in enumerate(ordered):
            if s.request.params.prompt_logprobs is not None and s.start < len(s.request.prompt_token_ids):
                prompt_at[b] = (len(rows), s.num_new_tokens)
                rows.extend(range(cu[b], cu[b + 1]))
            if s.completes:
                sample_at[b] = len(rows)
                rows.append(cu[b + 1] - 1)
        logits = None
        if rows:
            logits = self.model.compute_logits(paddle.gather(hidden, paddle.to_tensor(np.asarray(rows, np.int64)))).numpy()

        sample, prompt = [None] * len(seqs), [None] * len(seqs)
        for b, i in enumerate(order):
            if b in sample_at:
                sample[i] = logits[sample_at[b]]
            if b in prompt_at:
                r, n = prompt_at[b]
                prompt[i] = logits[r:r + n]
        return StepLogits(sample, prompt)
