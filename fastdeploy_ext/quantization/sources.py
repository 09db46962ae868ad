"""Quantized checkpoint tensors seen as lazily sliceable ``[out, in]`` matrices.

The linear layers' own weight loaders do the tensor-parallel geometry (which output rows and input columns
this rank holds, where they land in a fused parameter) by slicing the checkpoint tensor ``w[rows]`` or
``w[:, cols]``. A source here stands in for the float tensor: slicing it returns a :class:`QuantBlock` (codes,
scales, zero points of exactly those rows/columns), so every layout rule lives in one place and scales are
sharded with their rows and columns by construction.

An error about one checkpoint tensor (a scales shape that contradicts the group size, a wrong dtype) names that
tensor as the checkpoint spells it; ``what`` names the layer shard being loaded, for slicing errors.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fastdeploy_ext.layers.utils import WeightLoadError, as_float32, shape_of
from fastdeploy_ext.quantization.numerics import (
    INT4_ZERO,
    RawTensor,
    gptq_unpack_cols,
    gptq_unpack_rows,
    quantize_int4_groups,
    quantize_int4_rows,
    quantize_int8_rows,
)


@dataclass
class QuantBlock:
    """Rows ``[o]`` × columns ``[i]`` of a quantized weight, torch layout.

    ``codes`` ``[o, i]`` (int8 values, int4 nibbles 0..15 or fp8 bit patterns); ``scale`` ``[o, G]``;
    ``zero`` ``[o, G]`` or None (int4 symmetric: 8, others 0); ``g_idx`` ``[i]`` group of each input column
    (None: column ``c`` is in group ``c // group_size``). Dequantized: ``(codes - zero)[:, c] * scale[:, group(c)]``.
    """

    codes: np.ndarray
    scale: np.ndarray
    zero: np.ndarray | None = None
    g_idx: np.ndarray | None = None


def _index(idx, ndim_names: str):
    idx = idx if isinstance(idx, tuple) else (idx,)
    rows = idx[0]
    cols = idx[1] if len(idx) > 1 else slice(None)
    for s in (rows, cols):
        if not isinstance(s, slice) or s.step not in (None, 1):
            raise TypeError(f"{ndim_names} supports contiguous [rows, cols] slices only")
    return rows, cols


def _bounds(s: slice, n: int) -> tuple[int, int]:
    lo, hi, _ = s.indices(n)
    return lo, hi


def _group_span(lo: int, hi: int, width: int, group: int, what: str) -> tuple[int, int]:
    """Groups covering input columns ``[lo, hi)``; a shard boundary inside a group would split its scale."""
    if lo % group or (hi % group and hi != width):
        raise WeightLoadError(f"{what}: input columns [{lo}, {hi}) are not aligned to the group of {group} "
                              "(tensor_parallel_size must split the input dim into whole groups)")
    return lo // group, -(-hi // group)


class OnlineInt8Source:
    """A float checkpoint tensor quantized on slicing (wint8). A column slice (row-parallel rank) reads the
    whole rows once for their absmax, so each rank holds the tp=1 codes and the same per-channel scales."""

    def __init__(self, tensor, what: str):
        self.tensor, self.what = tensor, what
        self.shape = shape_of(tensor)

    def __getitem__(self, idx) -> QuantBlock:
        rows, cols = _index(idx, "OnlineInt8Source")
        if cols == slice(None):
            codes, scale = quantize_int8_rows(as_float32(self.tensor[rows]))
            return QuantBlock(codes, scale)
        full = as_float32(self.tensor[rows, :])
        codes, scale = quantize_int8_rows(full[:, cols], absmax=np.max(np.abs(full), axis=1))
        return QuantBlock(codes, scale)


class OnlineInt4Source:
    """A float checkpoint tensor quantized group-wise on slicing (wint4); reads only the sliced rows/columns.
    ``group_size`` -1 is one scale per row: like wint8, a column slice reads the whole rows for their absmax."""

    def __init__(self, tensor, group_size: int, what: str):
        self.tensor, self.group, self.what = tensor, group_size, what
        self.shape = shape_of(tensor)
        if group_size != -1 and self.shape[-1] % group_size:
            raise WeightLoadError(f"{what}: input width {self.shape[-1]} is not a multiple of the wint4 group_size "
                                  f"{group_size} (pass a smaller group_size or skip the module)")

    def __getitem__(self, idx) -> QuantBlock:
        rows, cols = _index(idx, "OnlineInt4Source")
        if self.group == -1:
            full = as_float32(self.tensor[rows, :])
            codes, scale = quantize_int4_rows(full[:, cols], absmax=np.max(np.abs(full), axis=1))
            return QuantBlock(codes, scale, np.full_like(scale, INT4_ZERO))
        lo, hi = _bounds(cols, self.shape[1])
        _group_span(lo, hi, self.shape[1], self.group, self.what)
        codes, scale = quantize_int4_groups(as_float32(self.tensor[rows, lo:hi]), self.group)
        return QuantBlock(codes, scale, np.full_like(scale, INT4_ZERO))


class GPTQSource:
    """One projection of an AutoGPTQ/optimum checkpoint (4 bits): ``qweight`` int32 ``[in/8, out]``, ``qzeros``
    int32 ``[G, out/8]``, ``scales`` fp16 ``[G, out]``, ``g_idx`` int32 ``[in]``.
    ``zero_offset`` is 1 for the original format (stored zero = z - 1) and 0 for ``gptq_v2``.

    With act-order (``desc_act``: ``g_idx`` is a permutation of groups) a column slice keeps every group, because
    its columns may belong to any of them; without it ``g_idx`` must be ``c // group_size``.
    """

    def __init__(self, parts: dict, group_size: int, zero_offset: int, desc_act: bool, what: str):
        self.what, self.zero_offset = what, zero_offset
        self.qweight = RawTensor.of(parts["qweight"], f"{what}.qweight")
        self.qzeros = RawTensor.of(parts["qzeros"], f"{what}.qzeros")
        self.scales = RawTensor.of(parts["scales"], f"{what}.scales")
        self.g_idx_t = RawTensor.of(parts["g_idx"], f"{what}.g_idx")
        for part, want in (("qweight", "I32"), ("qzeros", "I32")):
            got = getattr(self, part).st_dtype
            if got != want:
                raise WeightLoadError(f"'{getattr(self, part).name}': stored as {got}, GPTQ packs 4-bit values in int32")
        in8, out = self.qweight.shape
        width = in8 * 8
        groups = self.scales.shape[0]
        self.group = width if group_size == -1 else group_size
        if self.scales.shape != (-(-width // self.group), out):
            raise WeightLoadError(
                f"'{self.scales.name}' has shape {list(self.scales.shape)}: with input width {width} and quantization_config "
                f"group_size {group_size} it must be [{-(-width // self.group)}, {out}] (group size mismatch)")
        if self.qzeros.shape != (groups, out // 8) or out % 8:
            raise WeightLoadError(f"'{self.qzeros.name}' has shape {list(self.qzeros.shape)}, expected [{groups}, {out // 8}]")
        if self.g_idx_t.shape != (width,):
            raise WeightLoadError(f"'{self.g_idx_t.name}' has shape {list(self.g_idx_t.shape)}, expected [{width}]")
        self.shape = (out, width)
        g_idx = np.asarray(self.g_idx_t.array(), np.int64)
        if g_idx.min() < 0 or g_idx.max() >= groups:
            raise WeightLoadError(f"'{self.g_idx_t.name}' refers to groups outside [0, {groups})")
        if not desc_act and not np.array_equal(g_idx, np.arange(width) // self.group):
            raise WeightLoadError(f"'{self.g_idx_t.name}' is not column // group_size but quantization_config has desc_act false")
        # None: contiguous groups, which a row-parallel slice may cut to its own.
        self.g_idx = g_idx if desc_act else None

    def __getitem__(self, idx) -> QuantBlock:
        rows, cols = _index(idx, "GPTQSource")
        o_lo, o_hi = _bounds(rows, self.shape[0])
        i_lo, i_hi = _bounds(cols, self.shape[1])
        if i_lo % 8 or i_hi % 8 or o_lo % 8 or o_hi % 8:
            raise WeightLoadError(f"'{self.what}': a GPTQ shard must cover whole int32 words (rows [{o_lo}, {o_hi}), "
                                  f"columns [{i_lo}, {i_hi}) are not multiples of 8)")
        codes = gptq_unpack_rows(np.asarray(self.qweight.array()[i_lo // 8:i_hi // 8, o_lo:o_hi])).T
        if self.g_idx is None:
            g_lo, g_hi = _group_span(i_lo, i_hi, self.shape[1], self.group, f"'{self.what}'")
            g_idx = None
        else:
            g_lo, g_hi = 0, self.scales.shape[0]
            g_idx = self.g_idx[i_lo:i_hi]
        scale = self.scales.float32((slice(g_lo, g_hi), slice(o_lo, o_hi))).T
        zeros = gptq_unpack_cols(np.asarray(self.qzeros.array()[g_lo:g_hi, o_lo // 8:o_hi // 8]))
        zero = zeros.T.astype(np.float32) + np.float32(self.zero_offset)
        return QuantBlock(np.ascontiguousarray(codes), np.ascontiguousarray(scale), np.ascontiguousarray(zero), g_idx)


class BlockFP8Source:
    """One projection of a block-wise FP8 checkpoint: ``weight`` float8_e4m3fn ``[out, in]`` and
    ``weight_scale_inv`` ``[ceil(out/bo), ceil(in/bi)]`` (``w = fp8 * scale_inv`` per ``bo × bi`` block). The
    block scale is expanded to one scale per output row and input block, so any row slice (a fused shard at
    any offset, a column-parallel rank) keeps exact scales; column slices must fall on block boundaries."""

    def __init__(self, parts: dict, block: tuple[int, int], what: str):
        self.what, (self.bo, self.bi) = what, block
        self.weight = RawTensor.of(parts["weight"], f"{what}.weight")
        self.scale_inv = RawTensor.of(parts["weight_scale_inv"], f"{what}.weight_scale_inv")
        if self.weight.st_dtype != "F8_E4M3":
            raise WeightLoadError(f"'{self.weight.name}' is stored as {self.weight.st_dtype}; quant_method 'fp8' needs F8_E4M3")
        out, width = self.weight.shape
        want = (-(-out // self.bo), -(-width // self.bi))
        if self.scale_inv.shape != want:
            raise WeightLoadError(f"'{self.scale_inv.name}' has shape {list(self.scale_inv.shape)}; weight "
                                  f"[{out}, {width}] with weight_block_size [{self.bo}, {self.bi}] needs {list(want)}")
        self.shape = (out, width)

    def __getitem__(self, idx) -> QuantBlock:
        rows, cols = _index(idx, "BlockFP8Source")
        o_lo, o_hi = _bounds(rows, self.shape[0])
        i_lo, i_hi = _bounds(cols, self.shape[1])
        g_lo, g_hi = _group_span(i_lo, i_hi, self.shape[1], self.bi, f"'{self.what}'")
        codes = np.asarray(self.weight.array()[o_lo:o_hi, i_lo:i_hi])
        row_block = np.arange(o_lo, o_hi) // self.bo
        scale = self.scale_inv.float32()[row_block][:, g_lo:g_hi]
        return QuantBlock(np.ascontiguousarray(codes), np.ascontiguousarray(scale))
