"""Dasheng audio encoder and the MiDashengLM subsampling projector (Paddle).

Forward path (docs/models/midashenglm.md, "Encoder"): log-mel ``[B, 64, T]`` -> BatchNorm over mel bins (running
statistics only) -> (64, 4) patch conv -> ``[B, T_p, D]`` with ``T_p = T // 4`` -> chunks of ``target_length // 4``
patches that never attend to each other, each with the time position embedding restarting at 0 plus the frequency
embedding -> pre-norm ViT blocks -> final LayerNorm -> ``[B, T_p, D]`` at 25 Hz.

Parameter paths equal the checkpoint's (``audio_encoder.blocks.{i}.attn.qkv.weight`` ...), except BatchNorm's running
statistics, which follow Paddle's ``_mean`` / ``_variance`` naming (checkpoint ``running_mean`` / ``running_var``).
Every parameter carries ``weight_loader(param, loaded_weight, shard_id=None)`` taking the torch-layout tensor;
Linear weights are transposed to Paddle's ``[in, out]`` by the linear layers' loaders.

Tensor parallelism: qkv is a QKVParallelLinear (each rank takes its heads from each of the q, k, v sections),
proj and fc2 are row-parallel, fc1 column-parallel; everything else is replicated.
"""

from typing import Optional, Sequence, Tuple, Union

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle import nn

from fastdeploy_ext.config.dasheng import DashengConfig
from fastdeploy_ext.layers.backend import accum_dtype, compute_dtype
from fastdeploy_ext.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from fastdeploy_ext.layers.utils import create_param, default_weight_loader


def encoder_dtype(fd_config) -> str:
    """The encoder computes in max(float32, decoder dtype): the frontend's dB values and the pre-norm residual
    stream lose audible precision in bf16 (ms-swift forces audio_encoder.float() for the same reason)."""
    return accum_dtype(fd_config)

__all__ = [
    "DashengMlp",
    "DashengAttention",
    "DashengBlock",
    "DashengAudioEncoder",
    "AudioProjectorSubsample",
    "key_padding_mask",
]


def _attach_default_loaders(layer: nn.Layer, prefix: str) -> None:
    """Give parameters without a loader (norms, conv, embeddings) the whole-tensor loader and their checkpoint path."""
    for name, param in layer.named_parameters():
        if not hasattr(param, "weight_loader"):
            param.weight_loader = default_weight_loader
            param.param_path = f"{prefix}.{name}"


def key_padding_mask(num_samples: paddle.Tensor, num_patches: int, samples_per_patch: int) -> paddle.Tensor:
    """Keep-mask ``[B, num_patches]`` (True = valid key) from true sample counts ``[B]``.

    A patch is a valid key when ``j < num_samples // samples_per_patch``. The encoder produces
    ``(1 + L // 160) // 4`` patches, one more than ``L // 640`` when ``L mod 640 >= 480``; that last patch is an
    output (query) but not a key, as in the reference implementation.
    """
    valid = paddle.floor_divide(num_samples.astype("int64"), paddle.to_tensor(samples_per_patch, dtype="int64"))
    return paddle.arange(num_patches, dtype="int64").unsqueeze(0) < valid.unsqueeze(1)


class DashengMlp(nn.Layer):
    """``fc2(gelu_erf(fc1(x)))``: ``[..., D] -> [..., D]`` with hidden ``int(D * mlp_ratio)``."""

    def __init__(self, fd_config, prefix: str, config: DashengConfig):
        super().__init__()
        self.fc1 = ColumnParallelLinear(
            fd_config, f"{prefix}.fc1", config.embed_dim, config.mlp_hidden_dim, with_bias=True, weight_dtype=encoder_dtype(fd_config)
        )
        self.fc2 = RowParallelLinear(
            fd_config, f"{prefix}.fc2", config.mlp_hidden_dim, config.embed_dim, with_bias=True, weight_dtype=encoder_dtype(fd_config)
        )

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate=False))


class DashengAttention(nn.Layer):
    """Bidirectional multi-head self-attention with a key-padding mask.

    Written out as matmul + softmax: a fully-masked query row (possible only in an all-padding chunk or for the
    trailing patch alone in the last chunk) outputs exactly 0, never NaN and never the mean of V.
    """

    def __init__(self, fd_config, prefix: str, config: DashengConfig):
        super().__init__()
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.qkv = QKVParallelLinear(
            fd_config,
            f"{prefix}.qkv",
            hidden_size=config.embed_dim,
            num_heads=config.num_heads,
            kv_num_heads=config.num_heads,
            head_dim=config.head_dim,
            with_bias=config.qkv_bias,
            weight_dtype=encoder_dtype(fd_config),
        )
        self.num_heads_per_rank = self.qkv.num_heads_per_rank
        self.q_size = self.qkv.q_size
        self.proj = RowParallelLinear(
            fd_config, f"{prefix}.proj", config.embed_dim, config.embed_dim, with_bias=True, weight_dtype=encoder_dtype(fd_config)
        )

    def forward(self, x: paddle.Tensor, keep: Optional[paddle.Tensor] = None) -> paddle.Tensor:
        """x ``[B, N, D]``, keep ``[B, N]`` bool (True = key may be attended) or None -> ``[B, N, D]``."""
        batch, seq = x.shape[0], x.shape[1]
        q, k, v = paddle.split(self.qkv(x), [self.q_size, self.q_size, self.q_size], axis=-1)
        shape = [batch, seq, self.num_heads_per_rank, self.head_dim]
        q, k, v = (t.reshape(shape).transpose([0, 2, 1, 3]) for t in (q, k, v))
        scores = paddle.matmul(q, k, transpose_y=True) * self.scale
        if keep is not None:
            key_keep = keep.unsqueeze(1).unsqueeze(1)
            scores = paddle.where(key_keep, scores, paddle.full([], paddle.finfo(scores.dtype).min, scores.dtype))
            # Rows with a valid key are unchanged (masked terms are exactly 0); all-masked rows become 0.
            probs = F.softmax(scores, axis=-1) * key_keep.astype(scores.dtype)
        else:
            probs = F.softmax(scores, axis=-1)
        out = paddle.matmul(probs, v).transpose([0, 2, 1, 3]).reshape([batch, seq, -1])
        return self.proj(out)


class DashengBlock(nn.Layer):
    """Pre-norm transformer block: ``x + attn(LN1(x))``, then ``x + mlp(LN2(x))``; ``[B, N, D] -> [B, N, D]``."""

    def __init__(self, fd_config, prefix: str, config: DashengConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(config.embed_dim, epsilon=config.layer_norm_eps)
        self.attn = DashengAttention(fd_config, f"{prefix}.attn", config)
        self.norm2 = nn.LayerNorm(config.embed_dim, epsilon=config.layer_norm_eps)
        self.mlp = DashengMlp(fd_config, f"{prefix}.mlp", config)
        self.norm1.to(dtype=encoder_dtype(fd_config))
        self.norm2.to(dtype=encoder_dtype(fd_config))

    def forward(self, x: paddle.Tensor, keep: Optional[paddle.Tensor] = None) -> paddle.Tensor:
        x = x + self.attn(self.norm1(x), keep)
        return x + self.mlp(self.norm2(x))


class DashengMelBatchNorm(nn.Layer):
    """Inference BatchNorm over the mel-bin axis of ``[B, n_mels, T]``, always with the running statistics."""

    def __init__(self, num_features: int, eps: float, dtype: str = "float32"):
        super().__init__()
        self.eps = eps
        self.weight = create_param(self, [num_features], dtype, 1.0)
        self.bias = create_param(self, [num_features], dtype, 0.0)
        self._mean = create_param(self, [num_features], dtype, 0.0)
        self._variance = create_param(self, [num_features], dtype, 1.0)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        scale = self.weight / paddle.sqrt(self._variance + self.eps)
        return (x - self._mean.unsqueeze(-1)) * scale.unsqueeze(-1) + self.bias.unsqueeze(-1)


class DashengPatchEmbed(nn.Layer):
    """Conv2D(1 -> D, kernel = stride = (n_mels, 4)): ``[B, n_mels, T] -> [B, T // 4, D]`` (trailing T mod 4 frames dropped)."""

    def __init__(self, config: DashengConfig, dtype: str = "float32"):
        super().__init__()
        self.proj = nn.Conv2D(
            config.input_channels, config.embed_dim, kernel_size=config.patch_size, stride=config.patch_stride
        )
        self.proj.to(dtype=dtype)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        x = self.proj(x.unsqueeze(1))
        return x.squeeze(2).transpose([0, 2, 1])


class DashengAudioEncoder(nn.Layer):
    """Dasheng ViT over log-mel patches (MiDashengLM's ``audio_encoder``), in :func:`encoder_dtype`."""

    def __init__(self, fd_config, prefix: str = "audio_encoder", config: Optional[DashengConfig] = None):
        super().__init__()
        if config is None:
            config = fd_config.model_config.audio_encoder_config
        self.config = config
        self.prefix = prefix
        dim = config.embed_dim
        self.dtype = encoder_dtype(fd_config)
        self.init_bn = DashengMelBatchNorm(config.n_mels, config.batch_norm_eps, self.dtype)
        self.patch_embed = DashengPatchEmbed(config, self.dtype)
        self.time_pos_embed = create_param(self, [1, dim, 1, config.chunk_patches], self.dtype)
        self.freq_pos_embed = create_param(self, [1, dim, 1, 1], self.dtype)
        self.blocks = nn.LayerList([DashengBlock(fd_config, f"{prefix}.blocks.{i}", config) for i in range(config.depth)])
        self.norm = nn.LayerNorm(dim, epsilon=config.layer_norm_eps)
        self.norm.to(dtype=self.dtype)
        _attach_default_loaders(self, prefix)

    def _run_blocks(self, x: paddle.Tensor, keep: Optional[paddle.Tensor]) -> paddle.Tensor:
        """One chunk per batch row: x ``[n, t, D]`` (t <= chunk_patches), keep ``[n, t]`` or None."""
        time_pos = self.time_pos_embed[0, :, 0, : x.shape[1]].transpose([1, 0])
        x = x + time_pos + self.freq_pos_embed.reshape([1, 1, -1])
        for block in self.blocks:
            x = block(x, keep)
        return self.norm(x)

    def forward(
        self,
        features: paddle.Tensor,
        num_samples: Optional[Union[paddle.Tensor, Sequence[int], np.ndarray]] = None,
    ) -> Tuple[paddle.Tensor, Optional[paddle.Tensor]]:
        """Encode log-mel features.

        Args:
            features: ``[B, n_mels, T]`` in the encoder's dtype, from
                :func:`fastdeploy_ext.layers.audio.frontend.log_mel_spectrogram`.
            num_samples: ``[B]`` true waveform lengths in samples, used for the key-padding mask; ``None`` means no
                clip is padded and every patch is a key.

        Returns:
            ``(hidden [B, T // 4, D], keep [B, T // 4] bool or None)`` where ``keep`` marks valid keys.
        """
        if features.ndim != 3 or features.shape[1] != self.config.n_mels:
            raise ValueError(f"features must have shape [B, {self.config.n_mels}, T], got {list(features.shape)}")
        if features.dtype != getattr(paddle, self.dtype):
            raise TypeError(f"features must be {self.dtype} (the encoder's dtype), got {features.dtype}")
        batch, num_frames = features.shape[0], features.shape[2]
        num_patches = num_frames // self.config.frames_per_patch
        if num_patches == 0:
            raise ValueError(f"features have {num_frames} frames; a patch needs {self.config.frames_per_patch}")
        keep = None
        if num_samples is not None:
            if not isinstance(num_samples, paddle.Tensor):
                num_samples = paddle.to_tensor(np.asarray(num_samples, dtype=np.int64))
            if list(num_samples.shape) != [batch]:
                raise ValueError(f"num_samples must have shape [{batch}], got {list(num_samples.shape)}")
            keep = key_padding_mask(num_samples, num_patches, self.config.samples_per_patch)

        x = self.patch_embed(self.init_bn(features))
        # Full chunks are folded into the batch dimension (they never interact); the shorter tail chunk runs apart.
        chunk = self.config.chunk_patches
        full, tail = divmod(num_patches, chunk)
        outputs = []
        if full:
            head_x = x[:, : full * chunk].reshape([batch * full, chunk, -1])
            head_keep = None if keep is None else keep[:, : full * chunk].reshape([batch * full, chunk])
            outputs.append(self._run_blocks(head_x, head_keep).reshape([batch, full * chunk, -1]))
        if tail:
            tail_keep = None if keep is None else keep[:, full * chunk :]
            outputs.append(self._run_blocks(x[:, full * chunk :], tail_keep))
        hidden = outputs[0] if len(outputs) == 1 else paddle.concat(outputs, axis=1)
        return hidden, keep


class AudioProjectorSubsample(nn.Layer):
    """MiDashengLM ``audio_projector``: stack ``k`` consecutive frames, then Linear -> exact GELU -> Linear.

    ``[B, T, in_dim] -> [B, T // k, out_dim]``; the trailing ``T mod k`` frames are dropped. Parameters
    ``net.0`` (column-parallel, ``k * in_dim -> out_dim``) and ``net.2`` (row-parallel, ``out_dim -> out_dim``),
    both biased, in the decoder's compute dtype.
    """

    def __init__(
        self,
        fd_config,
        prefix: str = "audio_projector",
        in_dim: Optional[int] = None,
        out_dim: Optional[int] = None,
        downsample_rate: Optional[int] = None,
    ):
        super().__init__()
        if in_dim is None or out_dim is None or downsample_rate is None:
            if fd_config is None:
                raise ValueError(f"{prefix}: pass in_dim, out_dim and downsample_rate when fd_config is None")
            model_config = fd_config.model_config
            in_dim = model_config.audio_encoder_config.embed_dim if in_dim is None else in_dim
            out_dim = model_config.text_hidden_size if out_dim is None else out_dim
            downsample_rate = model_config.subsample_factor if downsample_rate is None else downsample_rate
        self.k = downsample_rate
        self.in_dim = in_dim
        self.dtype = compute_dtype(fd_config)
        self.net = nn.Sequential(
            ColumnParallelLinear(fd_config, f"{prefix}.net.0", in_dim * self.k, out_dim, with_bias=True),
            nn.GELU(approximate=False),
            RowParallelLinear(fd_config, f"{prefix}.net.2", out_dim, out_dim, with_bias=True),
        )

    def forward(
        self, x: paddle.Tensor, keep: Optional[paddle.Tensor] = None
    ) -> Tuple[paddle.Tensor, Optional[paddle.Tensor]]:
        """x ``[B, T, in_dim]``, keep ``[B, T]`` bool or None -> (``[B, T // k, out_dim]``, keep ``[B, T // k]``:
        a group is valid when any of its frames is)."""
        if x.ndim != 3 or x.shape[2] != self.in_dim:
            raise ValueError(f"projector input must have shape [B, T, {self.in_dim}], got {list(x.shape)}")
        batch, frames = x.shape[0], x.shape[1]
        groups = frames // self.k
        x = x[:, : groups * self.k].reshape([batch, groups, self.k * self.in_dim]).astype(self.dtype)
        if keep is not None:
            keep = keep[:, : groups * self.k].reshape([batch, groups, self.k]).any(axis=-1)
        return self.net(x), keep
