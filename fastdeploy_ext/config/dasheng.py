"""Typed config of the Dasheng audio encoder (``audio_encoder_config``) and the log-mel frontend it reads.

Encoder keys whose HF class default differs from the 7B value (embed_dim, depth, num_heads, patch_size,
patch_stride, target_length) are required: silently falling back to the class default would build a different
model. Frontend keys must equal the values below, which :mod:`fastdeploy_ext.layers.audio.frontend` implements.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from fastdeploy_ext.config.base import ConfigError, divide, get_key

# The log-mel frontend the package computes with (Dasheng's torchaudio MelSpectrogram settings).
SAMPLE_RATE = 16000
N_FFT = 512
WIN_LENGTH = 512
HOP_LENGTH = 160
N_MELS = 64
F_MIN = 0.0
F_MAX = 8000.0

# Frontend keys and the value the package's frontend computes with.
_FRONTEND_KEYS = {
    "sample_rate": SAMPLE_RATE,
    "n_fft": N_FFT,
    "win_length": WIN_LENGTH,
    "hop_length": HOP_LENGTH,
    "n_mels": N_MELS,
    "f_min": F_MIN,
    "f_max": F_MAX,
    "center": True,
}


def _pair(cfg: dict, key: str, where: str) -> Tuple[int, int]:
    value = get_key(cfg, key, where, types=(int, list, tuple))
    if isinstance(value, int):
        return (value, value)
    if len(value) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ConfigError(f"{where}: key '{key}' must be an int or a pair of ints, got {value!r}")
    return (value[0], value[1])


@dataclass(frozen=True)
class DashengConfig:
    """Dasheng audio encoder (``audio_encoder_config``).

    ``patch_size``/``patch_stride`` are (mel bins, frames); the model supports the MiDashengLM layout only:
    patches span all ``n_mels`` bins (frequency grid of 1) and 4 frames, so one patch = 40 ms and the
    attention chunk is ``target_length // 4`` patches.
    """

    embed_dim: int
    depth: int
    num_heads: int
    head_dim: int
    mlp_ratio: float
    mlp_hidden_dim: int
    patch_size: Tuple[int, int]
    patch_stride: Tuple[int, int]
    target_length: int
    n_mels: int
    qkv_bias: bool
    init_values: Optional[float] = None
    input_channels: int = 1
    layer_norm_eps: float = 1e-6
    batch_norm_eps: float = 1e-5
    sample_rate: int = SAMPLE_RATE
    hop_length: int = HOP_LENGTH

    @property
    def frames_per_patch(self) -> int:
        return self.patch_stride[1]

    @property
    def chunk_patches(self) -> int:
        """Patches per attention chunk (also the length of ``time_pos_embed``)."""
        return self.target_length // self.frames_per_patch

    @property
    def samples_per_patch(self) -> int:
        return self.hop_length * self.frames_per_patch

    @classmethod
    def from_hf_config(cls, cfg: dict, where: str = "audio_encoder_config") -> "DashengConfig":
        if not isinstance(cfg, dict):
            raise ConfigError(f"{where} must be a JSON object, got {type(cfg).__name__}")
        embed_dim = get_key(cfg, "embed_dim", where, types=(int,))
        depth = get_key(cfg, "depth", where, types=(int,))
        num_heads = get_key(cfg, "num_heads", where, types=(int,))
        for key, value in (("embed_dim", embed_dim), ("depth", depth), ("num_heads", num_heads)):
            if value < 1:
                raise ConfigError(f"{where}: key '{key}' must be >= 1, got {value}")
        head_dim = divide(embed_dim, num_heads, f"{where}: embed_dim / num_heads")
        mlp_ratio = float(get_key(cfg, "mlp_ratio", where, default=4.0, types=(int, float), gt=0))
        mlp_hidden_dim = int(embed_dim * mlp_ratio)
        if mlp_hidden_dim < 1:
            raise ConfigError(f"{where}: mlp_ratio {mlp_ratio} gives an empty MLP for embed_dim {embed_dim}")

        for key, want in _FRONTEND_KEYS.items():
            types = (float, int) if isinstance(want, float) else (type(want),)
            got = get_key(cfg, key, where, default=want, types=types)
            if got != want:
                raise ConfigError(f"{where}: key '{key}' = {got!r} is not supported (the audio frontend implements {want!r})")
        n_mels = N_MELS

        patch_size = _pair(cfg, "patch_size", where)
        patch_stride = _pair(cfg, "patch_stride", where)
        if patch_size != patch_stride:
            raise ConfigError(
                f"{where}: patch_size {list(patch_size)} != patch_stride {list(patch_stride)}; only gap-free, "
                "non-overlapping patches are supported"
            )
        if patch_size[0] != n_mels:
            raise ConfigError(
                f"{where}: patch_size {list(patch_size)} must span all n_mels={n_mels} mel bins (frequency grid of 1)"
            )
        if patch_size[1] != 4:
            raise ConfigError(
                f"{where}: patch_size {list(patch_size)} must cover 4 frames (MiDashengLM hard-codes target_length // 4 "
                "patches per chunk and hop_length * 4 samples per patch)"
            )
        target_length = get_key(cfg, "target_length", where, types=(int,))
        if target_length < patch_size[1]:
            raise ConfigError(f"{where}: target_length {target_length} is shorter than one patch ({patch_size[1]} frames)")
        input_channels = get_key(cfg, "input_channels", where, default=1, types=(int,))
        if input_channels != 1:
            raise ConfigError(f"{where}: key 'input_channels' = {input_channels} is not supported (mono log-mel input)")
        init_values = get_key(cfg, "init_values", where, default=None, types=(int, float))
        if init_values is not None:
            raise ConfigError(f"{where}: key 'init_values' = {init_values} (LayerScale) is not supported")
        return cls(
            embed_dim=embed_dim,
            depth=depth,
            num_heads=num_heads,
            head_dim=head_dim,
            mlp_ratio=mlp_ratio,
            mlp_hidden_dim=mlp_hidden_dim,
            patch_size=patch_size,
            patch_stride=patch_stride,
            target_length=target_length,
            n_mels=n_mels,
            qkv_bias=bool(get_key(cfg, "qkv_bias", where, default=True, types=(bool,))),
            init_values=None,
            input_channels=input_channels,
        )
