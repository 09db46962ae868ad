"""Audio input for MiDashengLM: decode, downmix and resample to 16 kHz mono float32, and count audio tokens.

The model applies no waveform normalisation, so the loader only scales integer PCM to [-1, 1) and never rescales
float audio.
"""

import io
import os
from typing import Tuple, Union

import numpy as np
import soundfile
import soxr

from .frontend import HOP_LENGTH, SAMPLE_RATE

PATCH_FRAMES = 4
SUBSAMPLE_FACTOR = 5
MIN_SAMPLES = 3200
MAX_CHANNELS = 8

AudioSource = Union[str, os.PathLike, bytes, bytearray, memoryview, np.ndarray, Tuple[np.ndarray, int]]

__all__ = ["MIN_SAMPLES", "load_audio", "pad_to_min_samples", "audio_token_count"]

_INT_SCALE = {np.dtype(np.int16): 1.0 / 32768.0, np.dtype(np.int32): 1.0 / 2147483648.0}


def _decode(data, what: str) -> Tuple[np.ndarray, int]:
    """Encoded audio -> (float32 mono [L], sample rate); libsndfile already scales integer PCM to [-1, 1)."""
    try:
        samples, sr = soundfile.read(data, dtype="float32", always_2d=True)
    except soundfile.LibsndfileError as err:
        raise ValueError(f"cannot decode {what}: {err}") from err
    return samples.mean(axis=1, dtype=np.float32), int(sr)


def _to_mono_float(array: np.ndarray, what: str) -> np.ndarray:
    if array.size == 0:
        raise ValueError(f"{what} is empty (shape {array.shape})")
    if array.dtype in _INT_SCALE:
        array = array.astype(np.float32) * np.float32(_INT_SCALE[array.dtype])
    elif array.dtype in (np.float32, np.float64):
        array = array.astype(np.float32, copy=False)
    else:
        raise TypeError(
            f"unsupported sample dtype {array.dtype} for {what}; expected int16, int32 (PCM, scaled by 2^-15 / 2^-31), "
            "float32 or float64 (used as is)"
        )
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


def load_audio(source: AudioSource, target_sr: int = SAMPLE_RATE) -> np.ndarray:
    """Decode ``source`` into a mono float32 waveform at ``target_sr`` Hz.

    Args:
        source: one of
            - a file path (any format libsndfile reads: WAV, FLAC, OGG, MP3, ...);
            - ``bytes`` of an encoded file (e.g. a base64-decoded WAV);
            - a numpy array **already at** ``target_sr``;
            - an ``(array, sample_rate)`` tuple.
            Arrays are ``[L]`` mono or 2-D multi-channel, either ``[L, C]`` or ``[C, L]``: the channel axis is the shorter
            one and has at most 8 entries. Channels are averaged. int16 / int32 PCM is scaled by 2^-15 / 2^-31;
            float32 / float64 samples are used unchanged.
        target_sr: output sample rate; the model expects 16000.

    Returns:
        float32 ``[L']`` mono waveform at ``target_sr`` (resampled with soxr "HQ" when the rates differ).

    Raises:
        FileNotFoundError: a path that does not exist.
        ValueError: undecodable data, empty audio, NaN/inf samples, a bad sample rate or an ambiguous array layout.
        TypeError: an unsupported source type or sample dtype.
    """
    target_sr = int(target_sr)
    if target_sr <= 0:
        raise ValueError(f"target_sr must be positive, got {target_sr}")
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"audio file not found: {path}")
        what = f"audio file {path!r}"
        waveform, sr = _decode(path, what)
    elif isinstance(source, (bytes, bytearray, memoryview)):
        if len(source) == 0:
            raise ValueError("audio bytes are empty")
        what = f"audio bytes ({len(source)} bytes)"
        waveform, sr = _decode(io.BytesIO(bytes(source)), what)
    elif isinstance(source, tuple):
        if len(source) != 2 or not isinstance(source[0], np.ndarray):
            raise TypeError("an audio tuple must be (numpy array, sample_rate)")
        array, sr = source
        if isinstance(sr, bool) or not isinstance(sr, (int, np.integer)) or sr <= 0:
            raise ValueError(f"sample rate of an (array, sample_rate) tuple must be a positive int, got {sr!r}")
        sr = int(sr)
        what = "audio array"
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
    if not np.isfinite(waveform).all():
        raise ValueError(f"{what} contains NaN or inf samples")
    if sr != target_sr:
        waveform = soxr.resample(waveform, sr, target_sr, quality="HQ").astype(np.float32, copy=False)
        if waveform.size == 0:
            raise ValueError(f"{what} is empty after resampling from {sr} Hz to {target_sr} Hz")
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
