"""Argument checks shared by the readable reference and the Triton kernels (host arrays in, ValueError out).

Each message names the argument and what it must be, so a caller sees the same error from every
implementation of the contract."""

import numpy as np


def check_cu_seqlens(cu: np.ndarray, total: int) -> None:
    if cu.ndim != 1 or cu.shape[0] < 1 or cu[0] != 0 or np.any(np.diff(cu) < 0) or cu[-1] != total:
        raise ValueError(
            f"cu_seqlens must start at 0, be non-decreasing and end at total_tokens={total}, got {cu.tolist()}"
        )


def check_slot_count(num_slot_ids: int, num_sequences: int) -> None:
    if num_slot_ids != num_sequences:
        raise ValueError(f"slot_ids has {num_slot_ids} entries but cu_seqlens describes {num_sequences} sequences")


def check_prefill_slots(slots: np.ndarray, num_slots: int) -> None:
    if np.any(slots < 0) or np.any(slots >= num_slots):
        raise ValueError(f"slot_ids must lie in [0, {num_slots}) for prefill, got {slots.tolist()}")
    if np.unique(slots).shape[0] != slots.shape[0]:
        raise ValueError(f"slot_ids must be distinct within one prefill batch, got {slots.tolist()}")


def check_decode_slots(slots: np.ndarray, num_slots: int) -> None:
    if np.any(slots < -1) or np.any(slots >= num_slots):
        raise ValueError(f"slot_ids must lie in [0, {num_slots}) or be -1, got {slots.tolist()}")
    live = slots[slots >= 0]
    if np.unique(live).shape[0] != live.shape[0]:
        raise ValueError(f"non-padding slot_ids must be distinct, got {slots.tolist()}")
