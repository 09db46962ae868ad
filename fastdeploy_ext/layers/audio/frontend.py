"""Log-mel frontend of the Dasheng audio encoder (MiDashengLM), in Paddle fp32.

Parameters follow the checkpoint's processor (docs/models/midashenglm.md, "Frontend"): 16 kHz mono, STFT n_fft 512 /
win 512 / hop 160 with a periodic Hann window, centred with reflect padding, power spectrum, 64 HTK mel bins over
0-8000 Hz without filter normalisation, ``10*log10(max(M, 1e-10))`` and a per-clip ``top_db`` of 120 dB.

Each clip is transformed on its own unpadded waveform, so its last frames see its own reflection rather than the
zeros of a padded batch; a clip therefore gives the same features batched or alone.
"""

from functools import lru_cache
from typing import Optional, Sequence, Union

import numpy as np
import paddle

from fastdeploy_ext.config.dasheng import F_MAX, F_MIN, HOP_LENGTH, N_FFT, N_MELS, SAMPLE_RATE, WIN_LENGTH

AMIN = 1e-10
TOP_DB = 120.0

__all__ = [
    "SAMPLE_RATE",
    "N_FFT",
    "WIN_LENGTH",
    "HOP_LENGTH",
    "N_MELS",
    "F_MIN",
    "F_MAX",
    "AMIN",
    "TOP_DB",
    "num_frames",
    "hann_window",
    "mel_filterbank",
    "log_mel_spectrogram",
]


def num_frames(num_samples: int) -> int:
    """Number of log-mel frames for a clip of ``num_samples`` samples: ``1 + num_samples // 160`` (centred STFT)."""
    num_samples = int(num_samples)
    if num_samples < 0:
        raise ValueError(f"num_samples must be >= 0, got {num_samples}")
    return 1 + num_samples // HOP_LENGTH


def _hz_to_mel_htk(freq: np.ndarray) -> np.ndarray:
    return 2595.0 * np.log10(1.0 + freq / 700.0)


def _mel_to_hz_htk(mel: np.ndarray) -> np.ndarray:
    return 700.0 * (10.0 ** (mel / 2595.0) - 1.0)


@lru_cache(maxsize=None)
def _mel_filterbank_np() -> np.ndarray:
    # float64 first: built in fp32 the small edge weights carry up to 5e-3 relative error (about 1.5e-3 dB).
    bin_freqs = np.linspace(0.0, SAMPLE_RATE / 2, N_FFT // 2 + 1, dtype=np.float64)
    mel_points = np.linspace(_hz_to_mel_htk(np.float64(F_MIN)), _hz_to_mel_htk(np.float64(F_MAX)), N_MELS + 2)
    edges = _mel_to_hz_htk(mel_points)
    widths = np.diff(edges)
    ramps = edges[:, None] - bin_freqs[None, :]
    lower = -ramps[:-2] / widths[:-1, None]
    upper = ramps[2:] / widths[1:, None]
    fb = np.maximum(0.0, np.minimum(lower, upper))
    fb.setflags(write=False)
    return fb


def mel_filterbank() -> np.ndarray:
    """HTK mel filterbank without normalisation, float64 ``[64, 257]`` (read-only; ``fb @ power`` maps bins to mels)."""
    return _mel_filterbank_np()


@lru_cache(maxsize=None)
def _hann_window_np() -> np.ndarray:
    n = np.arange(WIN_LENGTH, dtype=np.float64)
    window = 0.5 - 0.5 * np.cos(2.0 * np.pi * n / WIN_LENGTH)
    window.setflags(write=False)
    return window


def hann_window() -> np.ndarray:
    """Periodic Hann window, float64 ``[512]`` (read-only)."""
    return _hann_window_np()


# Paddle tensors are cached per (process, place) so the fp32 constants are built once and never come from a checkpoint.
_CONSTANTS = {}


def _constants(place, dtype: str) -> tuple:
    key = (str(place), dtype)
    if key not in _CONSTANTS:
        window = paddle.to_tensor(hann_window().astype(dtype), place=place)
        fb = paddle.to_tensor(mel_filterbank().astype(dtype), place=place)
        _CONSTANTS[key] = (window, fb)
    return _CONSTANTS[key]


def _as_waveforms(waveforms) -> paddle.Tensor:
    if isinstance(waveforms, np.ndarray):
        if waveforms.dtype != np.float32:
            raise TypeError(
                f"waveforms must be float32, got numpy {waveforms.dtype}; convert with .astype(np.float32) "
                "(integer PCM must be scaled first, see fastdeploy_ext.layers.audio.io.load_audio)"
            )
        waveforms = paddle.to_tensor(waveforms)
    elif not isinstance(waveforms, paddle.Tensor):
        raise TypeError(f"waveforms must be a paddle.Tensor or numpy.ndarray, got {type(waveforms).__name__}")
    if waveforms.dtype != paddle.float32:
        raise TypeError(f"waveforms must be float32, got {waveforms.dtype}")
    if waveforms.ndim != 2:
        raise ValueError(f"waveforms must have shape [batch, samples], got rank {waveforms.ndim} {list(waveforms.shape)}")
    batch, width = waveforms.shape
    if batch == 0:
        raise ValueError("waveforms has an empty batch dimension")
    if width == 0:
        raise ValueError("waveforms has 0 samples per clip (empty audio)")
    return waveforms


def _as_lengths(lengths, batch: int, width: int) -> np.ndarray:
    if lengths is None:
        return np.full([batch], width, dtype=np.int64)
    if isinstance(lengths, paddle.Tensor):
        lengths = lengths.numpy()
    lengths = np.asarray(lengths)
    if lengths.ndim != 1 or lengths.shape[0] != batch:
        raise ValueError(f"lengths must have shape [{batch}] (one per clip), got {list(lengths.shape)}")
    if not np.issubdtype(lengths.dtype, np.integer):
        raise TypeError(f"lengths must be integers, got {lengths.dtype}")
    for b, n in enumerate(lengths):
        if n <= 0:
            raise ValueError(f"clip {b} is empty (lengths[{b}] = {int(n)})")
        if n > width:
            raise ValueError(f"lengths[{b}] = {int(n)} exceeds the padded waveform width {width}")
    return lengths.astype(np.int64)


def _log_mel_same_length(clips: paddle.Tensor, window: paddle.Tensor, fb: paddle.Tensor) -> tuple:
    """``[n, L]`` fp32 clips of one common unpadded length -> (``[n, 64, 1 + L // 160]`` dB with per-clip top_db,
    ``[n, 1, 1]`` per-clip dB floor ``max(-100, clip_max - 120)``)."""
    spec = paddle.signal.stft(
        clips, N_FFT, HOP_LENGTH, WIN_LENGTH, window, center=True, pad_mode="reflect", normalized=False, onesided=True
    )
    power = paddle.as_real(spec).square().sum(axis=-1)
    mel = paddle.matmul(fb, power)
    log_mel = 10.0 * paddle.log10(paddle.clip(mel, min=AMIN))
    floor = paddle.clip(log_mel.amax(axis=[1, 2], keepdim=True) - TOP_DB, min=10.0 * np.log10(AMIN))
    return paddle.maximum(log_mel, floor), floor


def log_mel_spectrogram(
    waveforms: Union[paddle.Tensor, np.ndarray],
    lengths: Optional[Union[Sequence[int], np.ndarray, paddle.Tensor]] = None,
    dtype: str = "float32",
) -> paddle.Tensor:
    """Dasheng log-mel features.

    Args:
        waveforms: float32 ``[B, L]`` mono 16 kHz waveforms (zero-padded on the right when clips differ in length),
            a paddle tensor or a numpy array. No normalisation is applied.
        lengths: optional ``[B]`` true sample counts (``1 <= lengths[b] <= L``); ``None`` means every clip spans ``L``.
        dtype: of the computation and the result, ``"float32"`` or ``"float64"`` (the samples are float32 either way).

    Returns:
        ``[B, 64, T]`` in ``dtype`` with ``T = 1 + max(lengths) // 160``. Clip ``b`` fills frames ``[0, 1 + lengths[b] // 160)``;
        the remaining frames hold that clip's dB floor ``max(-100, clip_max - 120)``, which is what a zero-padded tail
        would produce.
    """
    waveforms = _as_waveforms(waveforms)
    batch, width = waveforms.shape
    lengths = _as_lengths(lengths, batch, width)
    min_len = int(lengths.min())
    if min_len <= N_FFT // 2:
        shortest = int(lengths.argmin())
        raise ValueError(
            f"clip {shortest} has {min_len} samples; reflect padding needs more than {N_FFT // 2} "
            f"(pad clips shorter than 3200 samples as fastdeploy_ext.layers.audio.io does)"
        )
    if not bool(paddle.isfinite(waveforms).all()):
        bad = np.flatnonzero(~np.isfinite(waveforms.numpy()).all(axis=1))
        raise ValueError(f"waveforms contain NaN or inf samples (clips {bad.tolist()})")

    if dtype not in ("float32", "float64"):
        raise ValueError(f"dtype must be 'float32' or 'float64', got {dtype!r}")
    waveforms = waveforms.astype(dtype)
    window, fb = _constants(waveforms.place, dtype)
    total_frames = num_frames(int(lengths.max()))
    rows = [None] * batch
    for length in np.unique(lengths):
        index = np.flatnonzero(lengths == length)
        clips = paddle.gather(waveforms, paddle.to_tensor(index), axis=0)[:, : int(length)]
        feats, floor = _log_mel_same_length(clips, window, fb)
        pad = total_frames - feats.shape[-1]
        if pad > 0:
            feats = paddle.concat([feats, floor.expand([feats.shape[0], N_MELS, pad])], axis=-1)
        for i, b in enumerate(index):
            rows[b] = feats[i]
    return paddle.stack(rows, axis=0)
