"""Audio input for MiDashengLM: decode, downmix and resample to 16 kHz mono float32, and count audio tokens.

The model applies no waveform normalisation, so the loader only scales integer PCM to [-1, 1) and never rescales
float audio: finite float samples are taken as they are, overshoots past 1.0 included (resampled or gain-adjusted
recordings have them; HF's feature extractor and vLLM take them too). Non-finite samples and peaks above 2^15 (int16
full scale: PCM passed as float, or garbage, whose squares would overflow the float32 frontend) are refused.

Encoded audio is bounded before it is decoded: the header (frames, rate, channels) is read first and a clip longer
than ``max_seconds`` or sampled outside 8-192 kHz is refused; then at most the header's frames + 1 are decoded,
block by block (downmixed and resampled per block), so memory follows the 16 kHz output, not the claimed input.
"""

import io
import math
import os
from dataclasses import dataclass
from typing import Callable, Optional, Tuple, Union

import numpy as np
import soundfile
import soxr

from .frontend import HOP_LENGTH, SAMPLE_RATE

PATCH_FRAMES = 4
SUBSAMPLE_FACTOR = 5
MIN_SAMPLES = 3200
MAX_CHANNELS = 8
MIN_SAMPLE_RATE = 8000
MAX_SAMPLE_RATE = 192000
DEFAULT_MAX_AUDIO_SECONDS = 300.0
# Largest float sample magnitude taken: int16 full scale. No float audio convention reaches it.
MAX_FLOAT_PEAK = 32768.0
# Frames per decoded block: one block of 8 channels of float32 is 2 MiB.
_BLOCK_FRAMES = 65536

AudioSource = Union[str, os.PathLike, bytes, bytearray, memoryview, np.ndarray, Tuple[np.ndarray, int]]

__all__ = ["MIN_SAMPLES", "AudioHeader", "read_audio_header", "load_audio", "pad_to_min_samples", "audio_token_count"]

# PCM integers scaled into [-1, 1); float samples used as they are.
_SAMPLE_SCALE = {np.dtype(np.int16): 1.0 / 32768.0, np.dtype(np.int32): 1.0 / 2147483648.0,
                 np.dtype(np.float32): 1.0, np.dtype(np.float64): 1.0}


@dataclass(frozen=True)
class AudioHeader:
    frames: int
    sample_rate: int
    channels: int
    format: str

    @property
    def seconds(self) -> float:
        return self.frames / self.sample_rate if self.sample_rate > 0 else math.inf


def read_audio_header(data, what: str) -> AudioHeader:
    """Frames, rate and channels from an encoded file (a path or bytes), without decoding any sample."""
    source = io.BytesIO(bytes(data)) if isinstance(data, (bytes, bytearray, memoryview)) else data
    try:
        with soundfile.SoundFile(source) as f:
            return AudioHeader(int(f.frames), int(f.samplerate), int(f.channels), str(f.format))
    except (soundfile.LibsndfileError, RuntimeError, TypeError) as err:
        raise ValueError(f"cannot decode {what}: {err}") from err


def check_audio_header(header: AudioHeader, what: str, max_seconds: float) -> None:
    """Refuse a clip by its header: rate outside 8-192 kHz, 0 or more than 8 channels, no frames, or longer than
    ``max_seconds``. Raises ValueError naming ``what``."""
    _check_rate(header.sample_rate, what)
    if not 1 <= header.channels <= MAX_CHANNELS:
        raise ValueError(f"{what} has {header.channels} channels; at most {MAX_CHANNELS} are supported")
    if header.frames <= 0:
        raise ValueError(f"{what} is empty (its header says {header.frames} frames)")
    if header.seconds > max_seconds:
        raise ValueError(f"{what} is {header.seconds:.1f} s long by its header ({header.frames} frames at "
                         f"{header.sample_rate} Hz); the limit is {max_seconds:g} s")


def _check_rate(sr: int, what: str) -> None:
    if not MIN_SAMPLE_RATE <= sr <= MAX_SAMPLE_RATE:
        raise ValueError(f"{what} is sampled at {sr} Hz; supported rates are {MIN_SAMPLE_RATE}-{MAX_SAMPLE_RATE} Hz")


def _check_samples(block: np.ndarray, what: str, scale: float = 1.0) -> None:
    """Finite samples whose peak, once multiplied by ``scale`` (PCM's 2^-15 / 2^-31), is at most 2^15: checked on the
    caller's own array, before a float32 cast could turn a large float64 into inf. PCM never reaches the bound."""
    if not np.isfinite(block).all():
        raise ValueError(f"{what} contains NaN or inf samples; every sample must be a finite number")
    peak = float(np.max(np.abs(block))) * scale if block.size else 0.0
    if peak > MAX_FLOAT_PEAK:
        raise ValueError(f"{what} has float samples up to |x| = {peak:.3g}, above 2^15 = 32768 (int16 full scale); "
                         "float audio is expected near [-1, 1]: if this is int16 PCM stored as float, divide it by 32768 "
                         "(or pass the int16 array)")


class _Resampler:
    """Mono float32 blocks in, ``target_sr`` out, through one soxr stream (identical to a one-shot
    ``soxr.resample`` of the concatenation)."""

    def __init__(self, sr: int, target_sr: int):
        self._stream = None if sr == target_sr else soxr.ResampleStream(sr, target_sr, 1, dtype="float32", quality="HQ")
        self._out = []

    def add(self, block: np.ndarray, last: bool = False) -> None:
        if self._stream is None:
            self._out.append(block)
        else:
            self._out.append(self._stream.resample_chunk(block, last=last).astype(np.float32, copy=False))

    def finish(self) -> np.ndarray:
        if self._stream is not None:
            self.add(np.zeros(0, np.float32), last=True)
        return np.concatenate(self._out) if self._out else np.zeros(0, np.float32)


def _decode(data, what: str, target_sr: int, max_seconds: float,
            on_frames: Optional[Callable[[int], None]] = None) -> np.ndarray:
    """Encoded audio -> float32 mono at ``target_sr``; libsndfile already scales integer PCM to [-1, 1).
    ``on_frames(n)`` is told the frames of every decoded block."""
    header = read_audio_header(data, what)
    check_audio_header(header, what, max_seconds)
    source = io.BytesIO(bytes(data)) if isinstance(data, (bytes, bytearray, memoryview)) else data
    resampler = _Resampler(header.sample_rate, target_sr)
    budget = header.frames + 1  # one more than the header admits: a header that undercounts is caught
    decoded = 0
    try:
        with soundfile.SoundFile(source) as f:
            while decoded < budget:
                block = f.read(min(_BLOCK_FRAMES, budget - decoded), dtype="float32", always_2d=True)
                if block.shape[0] == 0:
                    break
                decoded += block.shape[0]
                if on_frames is not None:
                    on_frames(block.shape[0])
                mono = block.mean(axis=1, dtype=np.float32)
                _check_samples(mono if block.shape[1] == 1 else block, what)
                resampler.add(mono)
    except soundfile.LibsndfileError as err:
        raise ValueError(f"cannot decode {what}: {err}") from err
    except MemoryError:
        raise ValueError(f"{what} is too large to decode") from None
    if decoded > header.frames:
        raise ValueError(f"{what} holds more audio than its header's {header.frames} frames")
    if decoded == 0:
        raise ValueError(f"{what} is empty (0 samples)")
    return resampler.finish()


def _to_mono_float(array: np.ndarray, what: str) -> np.ndarray:
    if array.size == 0:
        raise ValueError(f"{what} is empty (shape {array.shape})")
    scale = _SAMPLE_SCALE.get(array.dtype)
    if scale is None:
        raise TypeError(
            f"unsupported sample dtype {array.dtype} for {what}; expected int16, int32 (PCM, scaled by 2^-15 / 2^-31), "
            "float32 or float64 (used as is)"
        )
    _check_samples(array, what, scale)
    array = array.astype(np.float32) * np.float32(scale)
    if array.ndim == 1:
        return array
    if array.ndim != 2:
        raise ValueError(f"{what} must be 1-D [samples] or 2-D [samples, channels] / [channels, samples], got {array.shape}")
    rows, cols = array.shape
    # The channel axis is the short one: [L, C] (soundfile) when cols is small, [C, L] (librosa/torch) when rows is.
    if cols <= MAX_CHANNELS and rows > cols:
        return array.mean(axis=1, dtype=np.float32)
    if rows <= MAX_CHANNELS and cols > rows:
        return array.mean(axis=0, dtype=np.float32)
    raise ValueError(
        f"cannot tell the channel axis of {what} with shape {array.shape}: one axis must have at most "
        f"{MAX_CHANNELS} entries and be shorter than the other"
    )


def load_audio(source: AudioSource, target_sr: int = SAMPLE_RATE, max_seconds: float = DEFAULT_MAX_AUDIO_SECONDS,
               on_frames: Optional[Callable[[int], None]] = None) -> np.ndarray:
    """Decode ``source`` into a mono float32 waveform at ``target_sr`` Hz.

    Args:
        source: one of
            - a file path (any format libsndfile reads: WAV, FLAC, OGG, MP3, ...);
            - ``bytes`` of an encoded file (e.g. a base64-decoded WAV);
            - a numpy array **already at** ``target_sr``;
            - an ``(array, sample_rate)`` tuple.
            Arrays are ``[L]`` mono or 2-D multi-channel, either ``[L, C]`` or ``[C, L]``: the channel axis is the shorter
            one and has at most 8 entries. Channels are averaged. int16 / int32 PCM is scaled by 2^-15 / 2^-31;
            float32 / float64 samples are used unchanged: finite, with peaks up to 2^15 (overshoots past 1.0 are kept).
        target_sr: output sample rate; the model expects 16000.
        max_seconds: longest clip accepted (300 s by default); encoded audio is refused by its header, before decoding.
        on_frames: called with the number of frames of each decoded block (encoded sources only).

    Returns:
        float32 ``[L']`` mono waveform at ``target_sr`` (resampled with soxr "HQ" when the rates differ).

    Raises:
        FileNotFoundError: a path that does not exist.
        ValueError: undecodable data, empty audio, NaN/inf samples or float peaks above 2^15, a sample rate outside 8-192 kHz,
            a clip longer than ``max_seconds`` or an ambiguous array layout.
        TypeError: an unsupported source type or sample dtype.
    """
    target_sr = int(target_sr)
    if target_sr <= 0:
        raise ValueError(f"target_sr must be positive, got {target_sr}")
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"audio file not found: {path}")
        return _finish(_decode(path, f"audio file {path!r}", target_sr, max_seconds, on_frames), f"audio file {path!r}")
    if isinstance(source, (bytes, bytearray, memoryview)):
        if len(source) == 0:
            raise ValueError("audio bytes are empty")
        what = f"audio bytes ({len(source)} bytes)"
        return _finish(_decode(source, what, target_sr, max_seconds, on_frames), what)
    if isinstance(source, tuple):
        if len(source) != 2 or not isinstance(source[0], np.ndarray):
            raise TypeError("an audio tuple must be (numpy array, sample_rate)")
        array, sr = source
        if isinstance(sr, bool) or not isinstance(sr, (int, np.integer)) or sr <= 0:
            raise ValueError(f"sample rate of an (array, sample_rate) tuple must be a positive int, got {sr!r}")
        sr = int(sr)
        what = "audio array"
        _check_rate(sr, what)
        waveform = _to_mono_float(array, what)
    elif isinstance(source, np.ndarray):
        sr = target_sr
        what = "audio array"
        waveform = _to_mono_float(source, what)
    else:
        raise TypeError(
            f"unsupported audio source type {type(source).__name__}; expected a path, bytes, a numpy array "
            "or an (array, sample_rate) tuple"
        )

    if waveform.size == 0:
        raise ValueError(f"{what} is empty (0 samples)")
    if waveform.shape[0] / sr > max_seconds:
        raise ValueError(f"{what} is {waveform.shape[0] / sr:.1f} s long; the limit is {max_seconds:g} s")
    if sr != target_sr:
        resampler = _Resampler(sr, target_sr)
        resampler.add(waveform)
        waveform = resampler.finish()
    return _finish(waveform, what, sr, target_sr)


def _finish(waveform: np.ndarray, what: str, sr: int | None = None, target_sr: int | None = None) -> np.ndarray:
    if waveform.size == 0:
        raise ValueError(f"{what} is empty after resampling" + (f" from {sr} Hz to {target_sr} Hz" if sr else ""))
    return np.ascontiguousarray(waveform)


def pad_to_min_samples(waveform: np.ndarray) -> np.ndarray:
    """Zero-pad a ``[L]`` waveform shorter than 3200 samples (0.2 s) to 3200, as vLLM does, so it yields >= 1 token."""
    if waveform.ndim != 1:
        raise ValueError(f"waveform must be 1-D [samples], got shape {waveform.shape}")
    if waveform.shape[0] >= MIN_SAMPLES:
        return waveform
    return np.pad(waveform, (0, MIN_SAMPLES - waveform.shape[0]))


def audio_token_count(num_samples: int, subsample_factor: int = SUBSAMPLE_FACTOR) -> int:
    """Number of ``<|AUDIO|>`` tokens for a 16 kHz clip of ``num_samples`` samples.

    ``N(L) = ((1 + L // 160) // 4) // k`` (``k`` = the projector's ``subsample_factor``, 5 in every released
    checkpoint) with vLLM's clamp: ``L`` below 3200 counts as 3200 (the clip is zero-padded, see
    :func:`pad_to_min_samples`) and ``N >= 1``. k = 5: 1 s -> 5, 10 s -> 50, 10.08 s -> 50, 30 s -> 150.
    """
    if isinstance(num_samples, bool) or not isinstance(num_samples, (int, np.integer)):
        raise TypeError(f"num_samples must be an int, got {type(num_samples).__name__}")
    if num_samples <= 0:
        raise ValueError(f"num_samples must be positive, got {num_samples}")
    num_samples = max(int(num_samples), MIN_SAMPLES)
    frames = 1 + num_samples // HOP_LENGTH
    return max(1, frames // PATCH_FRAMES // subsample_factor)
