"""MiDashengLM's checkpoint tensor table: the Dasheng encoder, the projector and the Qwen2 decoder under
``decoder.model`` / ``decoder.lm_head``, with the parameter each one fills. ``MiDashengLMModel.load_weights``
routes by it; the engine's shape checks and the planner read it through the registry.
"""

from __future__ import annotations

from fastdeploy_ext.model_loader.shapes import ModelShape, Tensor
from fastdeploy_ext.models.midashenglm.config import MiDashengLMModelConfig
from fastdeploy_ext.models.qwen2.weights import QWEN2_IGNORED, qwen2_shape, qwen2_tensors

# Checkpoint tensors that are never loaded: BatchNorm's step counter, the mel filterbank / window some revisions
# persist (possibly bf16-rounded; the frontend recomputes them in float64) and the decoder's RoPE frequencies.
IGNORED_TENSORS = ("audio_encoder.init_bn.num_batches_tracked", "audio_encoder.front_end.0.spectrogram.window",
                   "audio_encoder.front_end.0.mel_scale.fb") + QWEN2_IGNORED
# Paddle's BatchNorm names its statistics differently.
_BATCH_NORM_PARAMS = {"running_mean": "_mean", "running_var": "_variance"}


def midashenglm_tensors(cfg: MiDashengLMModelConfig, head: str | None) -> list[Tensor]:
    """``head``: the decoder head's checkpoint name, None when tied. The 630 M-parameter encoder is replicated on
    every rank (docs/models/midashenglm.md: simpler than its tensor parallelism)."""
    enc = cfg.audio_encoder_config
    c, m = enc.embed_dim, enc.mlp_hidden_dim
    t = qwen2_tensors(cfg.text, "decoder.model", head)
    t += [Tensor("audio_encoder.patch_embed.proj.weight", (c, 1, *enc.patch_size), None, "encoder"),
          Tensor("audio_encoder.patch_embed.proj.bias", (c,), None, "encoder"),
          Tensor("audio_encoder.time_pos_embed", (1, c, 1, enc.chunk_patches), None, "encoder"),
          Tensor("audio_encoder.freq_pos_embed", (1, c, 1, 1), None, "encoder"),
          Tensor("audio_encoder.norm.weight", (c,), None, "encoder"), Tensor("audio_encoder.norm.bias", (c,), None, "encoder")]
    t += [Tensor(f"audio_encoder.init_bn.{n}", (enc.n_mels,), None, "encoder",
                 param=f"audio_encoder.init_bn.{_BATCH_NORM_PARAMS.get(n, n)}")
          for n in ("weight", "bias", "running_mean", "running_var")]
    for i in range(enc.depth):
        p = f"audio_encoder.blocks.{i}"
        for name, shape in ((f"{p}.norm1.weight", (c,)), (f"{p}.norm1.bias", (c,)), (f"{p}.norm2.weight", (c,)),
                            (f"{p}.norm2.bias", (c,)), (f"{p}.attn.qkv.weight", (3 * c, c)),
                            (f"{p}.attn.qkv.bias", (3 * c,)), (f"{p}.attn.proj.weight", (c, c)),
                            (f"{p}.attn.proj.bias", (c,)), (f"{p}.mlp.fc1.weight", (m, c)), (f"{p}.mlp.fc1.bias", (m,)),
                            (f"{p}.mlp.fc2.weight", (c, m)), (f"{p}.mlp.fc2.bias", (c,))):
            t.append(Tensor(name, shape, None, "encoder"))
    th = cfg.text.hidden_size
    t += [Tensor("audio_projector.net.0.weight", (th, cfg.projector_input_dim), None, "encoder"),
          Tensor("audio_projector.net.0.bias", (th,), None, "encoder"),
          Tensor("audio_projector.net.2.weight", (th, th), None, "encoder"),
          Tensor("audio_projector.net.2.bias", (th,), None, "encoder")]
    return t


def checkpoint_shape(raw: dict) -> ModelShape:
    cfg = MiDashengLMModelConfig.from_hf_config(raw)
    tensors = midashenglm_tensors(cfg, None if cfg.text.tie_word_embeddings else "decoder.lm_head.weight")
    shape = qwen2_shape(cfg.text, tensors)
    shape.arch, shape.ignored = cfg.architectures[0], IGNORED_TENSORS
    return shape
