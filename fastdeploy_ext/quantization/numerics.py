"""Quantization arithmetic on host arrays (NumPy, torch layout ``[out, in]``) and raw checkpoint reads.

Conventions shared by every method (docs/quantization.md):

- symmetric int8, one scale per output channel: ``s = max|w_row| / 127``, ``q = round(w / s)`` in ``[-127, 127]``;
- symmetric int4, one scale per output channel and group of ``g`` input channels: ``s = max|w_group| / 7``,
  ``q = round(w / s)`` in ``[-7, 7]``, stored as the unsigned nibble ``q + 8``;
- dequantization is always ``(code - zero) * scale`` in float32 (``zero`` = 8 for symmetric int4, 0 for int8
  and fp8), so a reference computing the same product gets bit-identical weights.

Rounding is half-to-even (``np.rint``); with ``s`` from the row/group's own absmax ``|w - q s| <= s / 2``.
"""

from __future__ import annotations

import json
import struct

import numpy as np

from fastdeploy_ext.layers.utils import WeightLoadError

INT8_QMAX = 127
INT4_QMAX = 7
INT4_ZERO = 8


def quantize_int8_rows(w: np.ndarray, absmax: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``w`` ``[o, i]`` float32 → (codes int8 ``[o, i]``, scale float32 ``[o, 1]``). ``absmax`` ``[o]`` overrides the
    per-row maximum (a row-parallel rank quantizes its columns with the scale of the whole row)."""
    amax = np.max(np.abs(w), axis=1) if absmax is None else absmax
    # An all-zero row gets scale 1 (codes 0), not 0: 0/0 would poison the row with NaN.
    scale = np.where(amax > 0, amax / np.float32(INT8_QMAX), np.float32(1.0)).astype(np.float32)[:, None]
    codes = np.clip(np.rint(w / scale), -INT8_QMAX, INT8_QMAX).astype(np.int8)
    return codes, scale


def quantize_int4_groups(w: np.ndarray, group_size: int) -> tuple[np.ndarray, np.ndarray]:
    """``w`` ``[o, i]`` float32, ``i % group_size == 0`` → (nibbles uint8 ``[o, i]`` in ``[1, 15]``, scale ``[o, i/g]``)."""
    o, i = w.shape
    if i % group_size:
        raise WeightLoadError(f"int4 quantization: input width {i} is not a multiple of group_size {group_size}")
    grouped = w.reshape(o, i // group_size, group_size)
    amax = np.max(np.abs(grouped), axis=2)
    scale = np.where(amax > 0, amax / np.float32(INT4_QMAX), np.float32(1.0)).astype(np.float32)
    q = np.clip(np.rint(grouped / scale[:, :, None]), -INT4_QMAX, INT4_QMAX).astype(np.int16)
    return (q + INT4_ZERO).astype(np.uint8).reshape(o, i), scale


def quantize_int4_rows(w: np.ndarray, absmax: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel int4 (group_size -1): ``w`` ``[o, i]`` → (nibbles ``[o, i]``, scale ``[o, 1]``); ``absmax``
    is the row maximum over the whole row when ``w`` holds only some of its columns (a row-parallel rank)."""
    amax = np.max(np.abs(w), axis=1) if absmax is None else absmax
    scale = np.where(amax > 0, amax / np.float32(INT4_QMAX), np.float32(1.0)).astype(np.float32)[:, None]
    q = np.clip(np.rint(w / scale), -INT4_QMAX, INT4_QMAX).astype(np.int16)
    return (q + INT4_ZERO).astype(np.uint8), scale


def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """Paddle-layout nibbles ``[in, out]`` (values 0..15) → uint8 ``[in/2, out]``: row ``2k`` in the low nibble,
    row ``2k+1`` in the high nibble (the byte order of GPTQ's little-endian int32 words)."""
    if codes.shape[0] % 2:
        raise WeightLoadError(f"int4 packing needs an even input width, got {codes.shape[0]}")
    return (codes[0::2] | (codes[1::2] << 4)).astype(np.uint8)


def gptq_unpack_rows(qweight: np.ndarray) -> np.ndarray:
    """AutoGPTQ ``qweight`` int32 ``[in/8, out]`` (input row ``8k+j`` in bits ``4j..4j+3`` of word ``k``) →
    nibbles uint8 ``[in, out]``."""
    words = np.ascontiguousarray(qweight).view(np.uint32)
    shifts = (4 * np.arange(8, dtype=np.uint32))[None, :, None]
    return ((words[:, None, :] >> shifts) & 0xF).astype(np.uint8).reshape(-1, qweight.shape[1])


def gptq_unpack_cols(qzeros: np.ndarray) -> np.ndarray:
    """AutoGPTQ ``qzeros`` int32 ``[G, out/8]`` (output column ``8c+j`` in bits ``4j..`` of word ``c``) → ``[G, out]``."""
    words = np.ascontiguousarray(qzeros).view(np.uint32)
    shifts = (4 * np.arange(8, dtype=np.uint32))[None, None, :]
    return ((words[:, :, None] >> shifts) & 0xF).astype(np.uint8).reshape(qzeros.shape[0], -1)


def fp8_e4m3fn_table() -> np.ndarray:
    """float32 value of each of the 256 float8_e4m3fn bit patterns (1 sign, 4 exponent bits with bias 7, 3 mantissa
    bits; no infinities; ``S.1111.111`` is NaN)."""
    bits = np.arange(256, dtype=np.int64)
    sign = np.where(bits & 0x80, -1.0, 1.0)
    exp = (bits >> 3) & 0xF
    man = (bits & 0x7).astype(np.float64)
    value = np.where(exp == 0, man / 8.0 * 2.0 ** -6, (1.0 + man / 8.0) * 2.0 ** (exp - 7.0)) * sign
    value[(bits & 0x7F) == 0x7F] = np.nan
    return value.astype(np.float32)


_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "I32": np.int32, "I64": np.int64,
              "I8": np.int8, "U8": np.uint8, "F8_E4M3": np.uint8, "I16": np.int16}


class RawTensor:
    """A checkpoint tensor read with its stored dtype (int32 words, fp8 bits, fp16 scales), lazily through a
    memory map: the model loader's tensors upcast to float32, which would corrupt packed integers."""

    def __init__(self, path: str, name: str):
        self.path, self.name = path, name
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        if name not in header:
            raise WeightLoadError(f"tensor '{name}' not found in {path}")
        meta = header[name]
        self.st_dtype = meta["dtype"]
        if self.st_dtype not in _ST_DTYPES:
            raise WeightLoadError(f"tensor '{name}': unsupported stored dtype {self.st_dtype}")
        self.shape = tuple(int(d) for d in meta["shape"])
        self._offset = 8 + n + int(meta["data_offsets"][0])

    @classmethod
    def of(cls, tensor, what: str) -> RawTensor:
        """The raw view of a model-loader ``LazyTensor`` (anything with ``path`` and ``name``)."""
        if isinstance(tensor, RawTensor):
            return tensor
        if not (hasattr(tensor, "path") and hasattr(tensor, "name")):
            raise WeightLoadError(f"{what}: pre-quantized tensors must come from a safetensors file")
        return cls(tensor.path, tensor.name)

    def array(self) -> np.ndarray:
        """The whole tensor as a read-only memory map (only the pages that are indexed get read)."""
        count = int(np.prod(self.shape)) if self.shape else 1
        return np.memmap(self.path, dtype=_ST_DTYPES[self.st_dtype], mode="r", offset=self._offset,
                         shape=self.shape or (count,))

    def float32(self, idx=slice(None)) -> np.ndarray:
        a = self.array()[idx]
        if self.st_dtype == "BF16":
            return (np.asarray(a, np.uint32) << 16).view(np.float32)
        return np.asarray(a, np.float32)
