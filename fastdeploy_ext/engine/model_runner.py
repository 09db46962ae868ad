"""Model runner: owns every cache tensor, turns a scheduled step into a ``ForwardMeta``, runs the
model and returns the fp32 logits rows the sampler needs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import paddle

from fastdeploy_ext.engine.sampler import DeviceRow, device_sampling
from fastdeploy_ext.engine.scheduler import ScheduledSeq
from fastdeploy_ext.layers.backend import AttentionBackend
from fastdeploy_ext.layers.forward_meta import ForwardMeta


# The warm-up prefill's matmul work bound (2 flops per parameter and token): about 0.1-0.2 s on 2 cores.
WARM_UP_FLOPS = 1e10
WARM_UP_MIN_TOKENS = 16


@dataclass
class StepLogits:
    """Per scheduled sequence (in the caller's order): the logits row to sample from (or None; a
    :class:`DeviceRow` when sampling on the device) and the logits rows for prompt positions
    ``[first_pos, first_pos + n)`` (or None)."""

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
        self.backend = AttentionBackend(fd_config)
        self.sample_on_device = device_sampling(fd_config)
        # Per softmax-attention layer: key and value pages, [kv_heads, num_blocks * block_size, head_dim].
        self.caches = [
            (paddle.zeros([s.num_kv_heads, rows, s.head_dim], dtype), paddle.zeros([s.num_kv_heads, rows, s.head_dim], dtype))
            for s in model.kv_cache_spec()
        ]
        spec = model.state_cache_spec()
        self.state_pool = None
        if spec is not None:
            # One [slots, *shape] tensor per recurrent layer (ops update a layer's pool in place), in
            # max(float32, compute dtype): a bf16 state drifts (minimax_m1.md §6).
            self.state_pool = [paddle.zeros([num_state_slots, *spec.shape], spec.dtype) for _ in range(spec.num_layers)]
        self._mm_inputs: dict[str, Any] = {}

    def copy_state(self, src_slot: int, dst_slot: int) -> None:
        if self.state_pool is not None:
            self.backend.copy_state(self.state_pool, [src_slot], [dst_slot])

    def fork(self, src_blocks, dst_blocks, src_slot, dst_slot) -> None:
        """Copy the KV pages ``src_blocks[:len(dst_blocks)]`` into ``dst_blocks`` and the recurrent
        state ``src_slot`` into ``dst_slot`` (an ``n > 1`` sibling starts from its parent's prompt)."""
        if len(dst_blocks):
            self.backend.copy_pages(self.caches, src_blocks, dst_blocks)
        if self.state_pool is not None:
            self.copy_state(src_slot, dst_slot)

    def warm_up(self, num_tokens: int, num_seqs: int, max_len: int) -> None:
        """One dummy prefill of up to ``num_tokens`` tokens over up to ``num_seqs`` sequences, without logits.

        The first step of a size touches fresh memory (Paddle's allocator grows, NumPy's buffers come from new
        pages). On the CPU VM of docs/benchmarks.md the MiniMax benchmark's first 2048-token prefill took 32.7k
        minor page faults and ~1.0 s against ~0.63 s for the next one; this pays that at start-up. The KV pages
        and state slots it writes are free: a request writes its KV before reading it, and a request starting
        at position 0 gets a zeroed state slot. The dummy prompt is bounded by :data:`WARM_UP_FLOPS`: a
        2048-token prefill of a 0.5B model is ~2 TFLOP, tens of seconds on 2 cores to save a fraction of one."""
        params = sum(int(p.numel()) for p in self.model.parameters())
        num_tokens = min(num_tokens, max(WARM_UP_MIN_TOKENS, int(WARM_UP_FLOPS // max(1, 2 * params))))
        bs = self.block_size
        seqs = max(1, min(num_seqs, num_tokens))
        length = max(1, min(max_len, -(-num_tokens // seqs)))
        seqs = max(1, min(seqs, self.num_kv_blocks // -(-length // bs)))
        length = min(length, self.num_kv_blocks * bs)
        blocks = -(-length // bs)
        vocab = self.fd_config.model_config.vocab_size
        self.execute_step([
            SeqInput(request_id=f"warm-up-{b}", token_ids=((np.arange(length) * 13 + b * 7919) % vocab).tolist(),
                     start=0, block_ids=list(range(b * blocks, (b + 1) * blocks)),
                     state_slot=b if self.state_pool is not None else None, prompt_len=length,
                     prompt_logits=False, completes=False)
            for b in range(seqs)
        ])

    def execute(self, seqs: list[ScheduledSeq]) -> StepLogits:
        return self.execute_step(make_seq_inputs(seqs))

    def release(self, request_ids) -> None:
        """Drop per-request host data (multimodal inputs and what the model cached in them)."""
        for rid in request_ids:
            self._mm_inputs.pop(rid, None)

    @paddle.no_grad()
    def execute_step(self, seqs: list["SeqInput"]) -> StepLogits:
        for s in seqs:
            # Keep the first object per request: a model may cache derived tensors in it (the audio
            # encoder runs once per clip per request), and tensor-parallel ranks receive it only once.
            if s.multimodal_inputs is not None:
                self._mm_inputs.setdefault(s.request_id, s.multimodal_inputs)
            s.multimodal_inputs = self._mm_inputs.get(s.request_id)
        # Decodes (one new token) first, by context length (attention groups similar lengths), then
        # multi-token prefill chunks in their scheduled order.
        order = sorted(range(len(seqs)), key=lambda i: (len(seqs[i].token_ids) > 1,
                                                        seqs[i].start if len(seqs[i].token_ids) == 1 else 0))
        ordered = [seqs[i] for i in order]
        num_decode = sum(1 for s in ordered if len(s.token_ids) == 1)

        ids, positions = [], []
        lens = np.array([len(s.token_ids) for s in ordered], np.int64)
        starts = np.array([s.start for s in ordered], np.int64)
        max_blocks = max(len(s.block_ids) for s in ordered)
        block_tables = np.zeros([len(ordered), max_blocks], np.int64)
        for b, s in enumerate(ordered):
            ids.extend(s.token_ids)
            positions.extend(range(s.start, s.start + len(s.token_ids)))
            block_tables[b, : len(s.block_ids)] = s.block_ids
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)

        slot_ids, saves = None, []
        if self.state_pool is not None:
            slot_ids = np.array([s.state_slot for s in ordered], np.int64)
            num_slots = self.state_pool[0].shape[0]
            # Checked once per step: the lightning ops then run unchecked (no host round trip per layer).
            if np.any(slot_ids < 0) or np.any(slot_ids >= num_slots) or len(np.unique(slot_ids)) != len(slot_ids):
                raise ValueError(f"state slots must be distinct and in [0, {num_slots}), got {slot_ids.tolist()}")
            fresh = [s.state_slot for s in ordered if s.start == 0]
            if fresh:
                # A sequence starting at position 0 (new, or recomputing after preemption) starts from zero state.
                self.backend.zero_state(self.state_pool, fresh)
            restores = [(s.restore_slot, s.state_slot) for s in ordered if s.restore_slot is not None]
            if restores:
                # A sequence resuming from the prefix cache starts from the snapshot at its resume position.
                self.backend.copy_state(self.state_pool, [a for a, _ in restores], [b for _, b in restores])
            saves = [(s.state_slot, s.save_slot) for s in ordered if s.save_slot is not None]

        rows, sample_at, prompt_at = [], {}, {}
        for b, s in enumerate(ordered):
            if s.prompt_logits:
                prompt_at[b] = (len(rows), len(s.token_ids))
                rows.extend(range(cu[b], cu[b + 1]))
            if s.completes:
                sample_at[b] = len(rows)
                rows.append(cu[b + 1] - 1)
        # Without prompt logits the rows are each sequence's last, ascending: a model that can computes
        # only them (its last layer skips the other tokens' attention output and MLP). All rows (a
        # decode-only step) need neither that nor a gather.
        every_row = len(rows) == int(cu[-1]) and not prompt_at
        output_rows = (np.asarray(rows, np.int64) if rows and not prompt_at and not every_row
                       and self.model.selects_output_rows else None)

        meta = ForwardMeta(
            ids_remove_padding=paddle.to_tensor(np.asarray(ids, np.int64)),
            position_ids=paddle.to_tensor(np.asarray(positions, np.int64)),
            seq_lens_this_time=lens,
            seq_lens_encoder=np.where(np.arange(len(ordered)) >= num_decode, lens, 0),
            seq_lens_decoder=starts,
            cu_seqlens_q=cu,
            block_tables=block_tables,
            caches=self.caches,
            num_decode=num_decode,
            state_pool=self.state_pool,
            slot_ids=slot_ids,
            output_rows=output_rows,
            extra={"requests": ordered},
        )
        self.backend.init_attention_metadata(meta)
        hidden = self.model(meta.ids_remove_padding, meta)
        if saves:
            self.backend.copy_state(self.state_pool, [a for a, _ in saves], [b for _, b in saves])

        logits = device_logits = None
        if rows:
            if output_rows is None and not every_row:
                hidden = paddle.gather(hidden, paddle.to_tensor(np.asarray(rows, np.int64)))
            logits = self.model.compute_logits(hidden)
            if self.sample_on_device:
                # The sampler reads the rows where they are; only a step with prompt logprobs copies them out.
                device_logits, logits = logits, (logits.numpy() if prompt_at else None)
            else:
                logits = logits.numpy()

        sample, prompt = [None] * len(seqs), [None] * len(seqs)
        for b, i in enumerate(order):
            if b in sample_at:
                sample[i] = logits[sample_at[b]] if device_logits is None else DeviceRow(device_logits, sample_at[b])
            if b in prompt_at:
                r, n = prompt_at[b]
                prompt[i] = logits[r:r + n]
        return StepLogits(sample, prompt)


@dataclass
class SeqInput:
    """What a rank needs of one scheduled sequence; picklable (sent to tensor-parallel ranks)."""

    request_id: str
    token_ids: list  # the tokens computed this step
    start: int  # position of token_ids[0] == tokens already cached
    block_ids: list
    state_slot: int | None
    prompt_len: int
    prompt_logits: bool  # logits of these prompt positions are wanted (prompt_logprobs)
    completes: bool  # the last row's logits are sampled from
    multimodal_inputs: Any = None
    restore_slot: int | None = None  # prefix snapshot copied into state_slot before the step
    save_slot: int | None = None  # prefix snapshot state_slot is copied into after the step


def make_seq_inputs(seqs: list[ScheduledSeq]) -> list[SeqInput]:
    out = []
    for s in seqs:
        r = s.request
        prefill = s.start < len(r.prompt_token_ids)
        out.append(SeqInput(
            request_id=r.request_id,
            token_ids=_token_slice(r, s.start, s.start + s.num_new_tokens),
            start=s.start,
            block_ids=list(r.block_ids),
            state_slot=r.state_slot,
            prompt_len=len(r.prompt_token_ids),
            prompt_logits=r.params.prompt_logprobs is not None and prefill,
            completes=s.completes,
            multimodal_inputs=r.multimodal_inputs if prefill else None,
            restore_slot=s.restore_slot,
            save_slot=s.save_slot,
        ))
    return out


def _token_slice(request, lo: int, hi: int) -> list:
    """``request.all_token_ids[lo:hi]`` without concatenating prompt and output (a decode step of a
    long prompt would otherwise copy the whole prompt every step)."""
    n = len(request.prompt_token_ids)
    if lo >= n:
        return request.output_token_ids[lo - n:hi - n]
    if hi <= n:
        return request.prompt_token_ids[lo:hi]
    return request.prompt_token_ids[lo:] + request.output_token_ids[: hi - n]
