"""Typed config for Qwen2-architecture decoders (also MiDashengLM's ``text_config``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from fastdeploy_ext.config.base import ConfigError, divide, get_key, rope_theta_of


@dataclass
class Qwen2Config:
    architectures: list
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    hidden_act: str = "silu"
    eos_token_id: list = field(default_factory=list)
    bos_token_id: int | None = None
    torch_dtype: str = "float32"

    @classmethod
    def from_hf_config(cls, cfg: dict, where: str = "config.json") -> "Qwen2Config":
        """Parse an HF ``Qwen2Config`` dict. Optional keys take HF ``Qwen2Config``'s own defaults,
        which define the format; keys that change the math and are not implemented are refused."""
        heads = get_key(cfg, "num_attention_heads", where, types=(int,), ge=1)
        hidden = get_key(cfg, "hidden_size", where, types=(int,), ge=1)
        kv_heads = get_key(cfg, "num_key_value_heads", where, default=heads, types=(int,), ge=1)
        if cfg.get("head_dim") is not None:
            head_dim = get_key(cfg, "head_dim", where, types=(int,), ge=1)
        else:
            head_dim = divide(hidden, heads, f"{where}: hidden_size / num_attention_heads (head_dim absent)")
        divide(heads, kv_heads, f"{where}: num_attention_heads / num_key_value_heads")
        if cfg.get("use_sliding_window"):
            raise ConfigError(f"{where}: use_sliding_window=true is not supported")
        scaling = cfg.get("rope_scaling") or {}
        rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
        params = cfg.get("rope_parameters") or {}
        rope_type = params.get("rope_type", rope_type)
        if rope_type != "default":
            raise ConfigError(f"{where}: rope type {rope_type!r} is not supported (only 'default')")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"{where}: hidden_act {act!r} is not supported (only 'silu')")
        eos = cfg.get("eos_token_id")
        eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(
            architectures=list(get_key(cfg, "architectures", where, default=["Qwen2ForCausalLM"], types=(list,))),
            vocab_size=get_key(cfg, "vocab_size", where, types=(int,), ge=1),
            hidden_size=hidden,
            intermediate_size=get_key(cfg, "intermediate_size", where, types=(int,), ge=1),
            num_hidden_layers=get_key(cfg, "num_hidden_layers", where, types=(int,), ge=1),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(get_key(cfg, "rms_norm_eps", where, default=1e-6, types=(int, float), gt=0)),
            rope_theta=rope_theta_of(cfg, where, default=10000.0),
            max_position_embeddings=get_key(cfg, "max_position_embeddings", where, default=32768, types=(int,), ge=2),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            hidden_act=act,
            eos_token_id=eos,
            bos_token_id=cfg.get("bos_token_id"),
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
        )
