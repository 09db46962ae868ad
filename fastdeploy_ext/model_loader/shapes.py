"""Checkpoint tensors (names, shapes, roles) implied by a config.json, per architecture.

The planner counts memory from them and the engine checks a checkpoint's safetensors headers against them
before anything is allocated."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Tensor:
    """One weight on one rank (torch layout ``[out, in]``): ``kind`` decides dtype and quantization."""

    name: str
    shape: tuple
    split: int | None  # dim split across ranks, None = replicated
    kind: str  # linear | expert | embed | lm_head | norm | router | encoder | bias
    kv_heads: int = 0  # k/v projections: number of KV heads (replicated when fewer than ranks)


@dataclass
class ModelShape:
    """What the planner needs from a model: its tensors and cache geometry."""

    arch: str
    tensors: list[Tensor]
    hidden_size: int
    vocab_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    num_full_layers: int
    num_linear_layers: int = 0
    linear_heads: int = 0
    linear_head_dim: int = 0
    widest_local: list = field(default_factory=list)  # callables tp -> per-token width of intermediates
    fp32_local: list = field(default_factory=list)  # callables tp -> per-token fp32 intermediates
    lm_head_fp32: bool = False
    max_position_embeddings: int = 0
    source: str = ""


def _qwen2_tensors(cfg, prefix: str, head: str | None) -> list[Tensor]:
    h, inter, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    t = [Tensor(f"{prefix}.embed_tokens.weight", (v, h), 0, "embed"), Tensor(f"{prefix}.norm.weight", (h,), None, "norm")]
    if head:
        t.append(Tensor(head, (v, h), 0, "lm_head"))
    for i in range(cfg.num_hidden_layers):
        p = f"{prefix}.layers.{i}"
        t += [Tensor(f"{p}.input_layernorm.weight", (h,), None, "norm"),
              Tensor(f"{p}.post_attention_layernorm.weight", (h,), None, "norm"),
              Tensor(f"{p}.self_attn.q_proj.weight", (q, h), 0, "linear"),
              Tensor(f"{p}.self_attn.q_proj.bias", (q,), 0, "bias"),
              Tensor(f"{p}.self_attn.o_proj.weight", (h, q), 1, "linear"),
              Tensor(f"{p}.mlp.gate_proj.weight", (inter, h), 0, "linear"),
              Tensor(f"{p}.mlp.up_proj.weight", (inter, h), 0, "linear"),
              Tensor(f"{p}.mlp.down_proj.weight", (h, inter), 1, "linear")]
        for n in ("k", "v"):
            t += [Tensor(f"{p}.self_attn.{n}_proj.weight", (kv, h), 0, "linear", cfg.num_key_value_heads),
                  Tensor(f"{p}.self_attn.{n}_proj.bias", (kv,), 0, "bias", cfg.num_key_value_heads)]
    return t


def _qwen2_shape(raw: dict) -> ModelShape:
    from fastdeploy_ext.models.qwen2.config import Qwen2Config

    cfg = Qwen2Config.from_hf_config(raw)
    head = None if cfg.tie_word_embeddings else "lm_head.weight"
    return ModelShape(
        arch="Qwen2ForCausalLM", tensors=_qwen2_tensors(cfg, "model", head), hidden_size=cfg.hidden_size,
        vocab_size=cfg.vocab_size, num_attention_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, num_full_layers=cfg.num_hidden_layers,
        widest_local=[lambda tp, c=cfg: 2 * c.intermediate_size // tp,
                      lambda tp, c=cfg: (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim // tp],
        max_position_embeddings=cfg.max_position_embeddings)


def _minimax_shape(raw: dict) -> ModelShape:
    from fastdeploy_ext.models.minimax_m1.config import LINEAR, MiniMaxM1Config

    cfg = MiniMaxM1Config.from_hf_config(raw)
    h, v, d, heads, kvh = cfg.hidden_size, cfg.vocab_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    hd, inter, e = heads * d, cfg.intermediate_size, cfg.num_local_experts
    t = [Tensor("model.embed_tokens.weight", (v, h), 0, "embed"), Tensor("model.norm.weight", (h,), None, "norm"),
         Tensor("lm_head.weight", (v, h), 0, "lm_head")]
    for i, kind in enumerate(cfg.layer_types):
        p = f"model.layers.{i}"
        t += [Tensor(f"{p}.input_layernorm.weight", (h,), None, "norm"),
              Tensor(f"{p}.post_attention_layernorm.weight", (h,), None, "norm"),
              Tensor(f"{p}.block_sparse_moe.gate.weight", (e, h), None, "router")]
        for x in range(e):
            ep = f"{p}.block_sparse_moe.experts.{x}"
            t += [Tensor(f"{ep}.w1.weight", (inter, h), 0, "expert"), Tensor(f"{ep}.w3.weight", (inter, h), 0, "expert"),
                  Tensor(f"{ep}.w2.weight", (h, inter), 1, "expert")]
        if kind == LINEAR:
            # qkv rows are head-major ([q;k;v] per head), so a contiguous row split gives whole heads.
            t += [Tensor(f"{p}.self_attn.qkv_proj.weight", (3 * hd, h), 0, "linear"),
                  Tensor(f"{p}.self_attn.output_gate.weight", (hd, h), 0, "linear"),
                  Tensor(f"{p}.self_attn.out_proj.weight", (h, hd), 1, "linear"),
                  Tensor(f"{p}.self_attn.norm.weight", (hd,), 0, "norm")]
        else:
            t += [Tensor(f"{p}.self_attn.q_proj.weight", (hd, h), 0, "linear"),
                  Tensor(f"{p}.self_attn.k_proj.weight", (kvh * d, h), 0, "linear", kvh),
                  Tensor(f"{p}.self_attn.v_proj.weight", (kvh * d, h), 0, "linear", kvh),
                  Tensor(f"{p}.self_attn.o_proj.weight", (h, hd), 1, "linear")]
    top_k = cfg.num_experts_per_tok
    return ModelShape(
        arch=cfg.architectures[0], tensors=t, hidden_size=h, vocab_size=v, num_attention_heads=heads,
        num_kv_heads=kvh, head_dim=d, num_full_layers=len(cfg.full_attention_layers),
        num_linear_layers=len(cfg.linear_attention_layers), linear_heads=heads, linear_head_dim=d,
        # MoE: gate+up rows of every routed copy; lightning: qkv + output gate.
        widest_local=[lambda tp: top_k * 2 * inter // tp, lambda tp: 4 * hd // tp],
        # Lightning q, k, v, output in fp32, plus one 256-token block's per-head KV state per block.
        fp32_local=[lambda tp: 4 * hd // tp + (hd // tp) * d // cfg.block_size],
        lm_head_fp32=True, max_position_embeddings=cfg.max_position_embeddings)


def _midashenglm_shape(raw: dict) -> ModelShape:
    from fastdeploy_ext.models.midashenglm.config import MiDashengLMConfig
    from fastdeploy_ext.models.qwen2.config import Qwen2Config

    cfg = MiDashengLMConfig.from_hf_config(raw)
    text = Qwen2Config.from_hf_config(cfg.text_config, where="config.json: text_config")
    enc = cfg.audio_encoder_config
    c, m = enc.embed_dim, enc.mlp_hidden_dim
    t = _qwen2_tensors(text, "decoder.model", None if text.tie_word_embeddings else "decoder.lm_head.weight")
    # The 630 M-parameter encoder is replicated on every rank (specs/midashenglm.md §7: simpler than its TP).
    t += [Tensor("audio_encoder.patch_embed.proj.weight", (c, 1, *enc.patch_size), None, "encoder"),
          Tensor("audio_encoder.patch_embed.proj.bias", (c,), None, "encoder"),
          Tensor("audio_encoder.time_pos_embed", (1, c, 1, enc.chunk_patches), None, "encoder"),
          Tensor("audio_encoder.freq_pos_embed", (1, c, 1, 1), None, "encoder"),
          Tensor("audio_encoder.norm.weight", (c,), None, "encoder"), Tensor("audio_encoder.norm.bias", (c,), None, "encoder")]
    t += [Tensor(f"audio_encoder.init_bn.{n}", (enc.n_mels,), None, "encoder")
          for n in ("weight", "bias", "running_mean", "running_var")]
    for i in range(enc.depth):
        p = f"audio_encoder.blocks.{i}"
        for name, shape in ((f"{p}.norm1.weight", (c,)), (f"{p}.norm1.bias", (c,)), (f"{p}.norm2.weight", (c,)),
                            (f"{p}.norm2.bias", (c,)), (f"{p}.attn.qkv.weight", (3 * c, c)),
                            (f"{p}.attn.qkv.bias", (3 * c,)), (f"{p}.attn.proj.weight", (c, c)),
                            (f"{p}.attn.proj.bias", (c,)), (f"{p}.mlp.fc1.weight", (m, c)), (f"{p}.mlp.fc1.bias", (m,)),
                            (f"{p}.mlp.fc2.weight", (c, m)), (f"{p}.mlp.fc2.bias", (c,))):
            t.append(Tensor(name, shape, None, "encoder"))
    th = text.hidden_size
    t += [Tensor("audio_projector.net.0.weight", (th, cfg.projector_input_dim), None, "encoder"),
          Tensor("audio_projector.net.0.bias", (th,), None, "encoder"),
          Tensor("audio_projector.net.2.weight", (th, th), None, "encoder"),
          Tensor("audio_projector.net.2.bias", (th,), None, "encoder")]
    shape = _qwen2_shape({**cfg.text_config, "architectures": ["Qwen2ForCausalLM"]})
    shape.arch, shape.tensors = cfg.architectures[0], t
    return shape


_SHAPES = {
    "Qwen2ForCausalLM": _qwen2_shape,
    "MiniMaxM1ForCausalLM": _minimax_shape,
    "MiniMaxText01ForCausalLM": _minimax_shape,
    "MiniMaxForCausalLM": _minimax_shape,
    "MiDashengLMModel": _midashenglm_shape,
}


def _count(raw, key: str) -> int:
    value = raw.get(key, 0) if isinstance(raw, dict) else 0
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def implied_tensor_count(raw: dict) -> int:
    """A lower bound on the tensors a config.json implies, from its layer and expert counts alone (nothing built
    per layer): every decoder layer holds at least its 2 norms and 4 attention projections (a MoE layer also
    3 per expert), every encoder block 12 tensors."""
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    layers = _count(text, "num_hidden_layers")
    per_layer = 6 + 3 * _count(text, "num_local_experts")
    encoder = raw.get("audio_encoder_config") if isinstance(raw.get("audio_encoder_config"), dict) else {}
    return layers * per_layer + 12 * _count(encoder, "depth")


def config_tensor_shapes(raw: dict, max_tensors: int | None = None) -> dict[str, tuple] | None:
    """Checkpoint tensor name -> shape implied by a config.json dict (None for an architecture the planner
    does not know). ``max_tensors``: refuse (ValueError) before building anything a config whose layer and
    expert counts imply more tensors than that (``num_hidden_layers: 10000000`` over a 560 KB checkpoint)."""
    archs = raw.get("architectures") or ["?"]
    derive = _SHAPES.get(archs[0]) if isinstance(archs, list) and isinstance(archs[0], str) else None
    if derive is None:
        return None
    if max_tensors is not None and implied_tensor_count(raw) > max_tensors:
        raise ValueError(f"config.json implies at least {implied_tensor_count(raw):,} tensors (its layer and expert "
                         f"counts), more than the {max_tensors:,} allowed")
    return {t.name: t.shape for t in derive(raw).tensors}


# Paddle creates parameters from int32 shape entries: a dimension of 2**31 or more is an IndexError deep in Paddle.
MAX_DIM = 2**31 - 1


def check_dims(expected: dict[str, tuple]) -> None:
    """ValueError naming the first implied tensor with a dimension Paddle cannot index (2**31 or more)."""
    for name, shape in expected.items():
        if any(d > MAX_DIM for d in shape):
            raise ValueError(f"config.json implies '{name}' of shape {list(shape)}: a dimension of 2**31 or more "
                             "(Paddle indexes shapes with int32)")
