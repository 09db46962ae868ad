"""Typed config for MiniMax-M1 / MiniMax-Text-01 (hybrid lightning + GQA decoder with a top-k MoE).

Two on-disk formats (docs/models/minimax_m1.md):

- original remote code (``model_type`` ``minimax_m1`` / ``minimax_text_01``): ``attn_type_list`` (ints),
  ``rotary_dim``, ``layernorm_{full_attention,linear_attention,mlp}_{alpha,beta}``, ``postnorm``,
  ``shared_intermediate_size``, optional ``block``;
- HF-native (``model_type`` ``minimax``): ``layer_types`` (strings), ``{full_attn,linear_attn,mlp}_
  {alpha,beta}_factor``, ``rope_parameters``, ``partial_rotary_factor``, ``block_size``.

Every value that changes the math is required (no Mixtral-like defaults, no hard-coded layer list).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fastdeploy_ext.config.base import ConfigError, divide, get_key, rope_theta_of

LINEAR = "linear_attention"
FULL = "full_attention"
# attn_type_list / decoder_attention_types code: 0 = lightning, 1 = softmax.
_TYPE_CODES = {0: LINEAR, 1: FULL}
# (original key prefix, HF-native key prefix) per sublayer of the DeepNorm residual.
_RESIDUAL_KEYS = {
    "linear_attn": ("layernorm_linear_attention", "linear_attn"),
    "full_attn": ("layernorm_full_attention", "full_attn"),
    "mlp": ("layernorm_mlp", "mlp"),
}
# Original remote code hard-codes the lightning prefill block (256); it only changes rounding.
DEFAULT_BLOCK_SIZE = 256


@dataclass
class MiniMaxM1Config:
    architectures: list
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # per expert
    num_hidden_layers: int
    num_attention_heads: int  # both layer types
    num_key_value_heads: int  # GQA layers
    head_dim: int
    rotary_dim: int  # leading channels of each GQA head that rotate (NeoX pairing)
    rope_theta: float
    layer_types: list  # "linear_attention" | "full_attention" per global layer index
    num_local_experts: int
    num_experts_per_tok: int
    rms_norm_eps: float
    max_position_embeddings: int
    # DeepNorm residual factors: out = alpha * residual + beta * sublayer(normed)
    linear_attn_alpha: float
    linear_attn_beta: float
    full_attn_alpha: float
    full_attn_beta: float
    mlp_alpha: float
    mlp_beta: float
    postnorm: bool = True
    block_size: int = DEFAULT_BLOCK_SIZE
    # Lightning output RMSNorm: 1e-6 is the original/HF class default, vLLM hard-codes 1e-5.
    lightning_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    eos_token_id: list = field(default_factory=list)
    bos_token_id: int | None = None
    torch_dtype: str = "float32"

    @property
    def full_attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == FULL]

    @property
    def linear_attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == LINEAR]

    def residual_factors(self, layer_id: int) -> tuple[float, float, float, float]:
        """``(attn_alpha, attn_beta, mlp_alpha, mlp_beta)`` of a layer, by its type."""
        if self.layer_types[layer_id] == LINEAR:
            return self.linear_attn_alpha, self.linear_attn_beta, self.mlp_alpha, self.mlp_beta
        return self.full_attn_alpha, self.full_attn_beta, self.mlp_alpha, self.mlp_beta

    @classmethod
    def from_hf_config(cls, cfg: dict, where: str = "config.json") -> "MiniMaxM1Config":
        """Parse either checkpoint format; errors name the offending key and ``where``."""
        num_layers = get_key(cfg, "num_hidden_layers", where, types=(int,), ge=1)
        heads = get_key(cfg, "num_attention_heads", where, types=(int,), ge=1)
        kv_heads = get_key(cfg, "num_key_value_heads", where, types=(int,), ge=1)
        # Never derived: M1's hidden/heads = 96 but head_dim is 128 (H*D != hidden).
        head_dim = get_key(cfg, "head_dim", where, types=(int,), ge=1)
        divide(heads, kv_heads, f"{where}: num_attention_heads / num_key_value_heads")
        layer_types = _layer_types(cfg, num_layers, where)
        if num_layers < 2 and LINEAR in layer_types:
            raise ConfigError(f"{where}: lightning slopes need num_hidden_layers >= 2 (the layer factor divides by L-1)")

        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"{where}: hidden_act {act!r} is not supported (only 'silu')")
        if cfg.get("sliding_window") is not None:
            raise ConfigError(f"{where}: sliding_window={cfg['sliding_window']!r} is not supported (MiniMax uses none)")
        shared = cfg.get("shared_intermediate_size") or 0
        if shared > 0:
            raise ConfigError(f"{where}: shared_intermediate_size={shared} (shared expert) is not implemented")
        params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type != "default":
            raise ConfigError(f"{where}: rope type {rope_type!r} is not supported (only 'default')")
        if cfg.get("tie_word_embeddings"):
            raise ConfigError(f"{where}: tie_word_embeddings=true is not supported for MiniMax (lm_head is separate)")

        postnorm = cfg.get("postnorm")
        if "attn_type_list" in cfg or "decoder_attention_types" in cfg:
            # Original format: the key decides the residual; vLLM's silent default (false) is wrong for every checkpoint.
            postnorm = get_key(cfg, "postnorm", where, types=(bool,))
        else:
            # HF-native hard-codes post-norm and ignores a leftover legacy key; honouring a stray
            # `postnorm: false` would silently diverge from every implementation of this format.
            if postnorm is False:
                raise ConfigError(f"{where}: postnorm=false in an HF-native (layer_types) config: that format is "
                                  "always post-norm; remove the key")
            postnorm = True
        experts = get_key(cfg, "num_local_experts", where, types=(int,), ge=1)
        top_k = get_key(cfg, "num_experts_per_tok", where, types=(int,))
        if not 1 <= top_k <= experts:
            raise ConfigError(f"{where}: num_experts_per_tok={top_k} must be in [1, num_local_experts={experts}]")
        factors = {}
        for name, (orig, native) in _RESIDUAL_KEYS.items():
            for suffix in ("alpha", "beta"):
                factors[f"{name}_{suffix}"] = _either(cfg, f"{orig}_{suffix}", f"{native}_{suffix}_factor", where)

        eos = cfg.get("eos_token_id")
        eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(
            architectures=list(get_key(cfg, "architectures", where, types=(list,))),
            vocab_size=get_key(cfg, "vocab_size", where, types=(int,), ge=1),
            hidden_size=get_key(cfg, "hidden_size", where, types=(int,), ge=1),
            intermediate_size=get_key(cfg, "intermediate_size", where, types=(int,), ge=1),
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rotary_dim=_rotary_dim(cfg, head_dim, where),
            rope_theta=rope_theta_of(cfg, where),
            layer_types=layer_types,
            num_local_experts=experts,
            num_experts_per_tok=top_k,
            rms_norm_eps=float(get_key(cfg, "rms_norm_eps", where, types=(int, float), gt=0)),
            max_position_embeddings=get_key(cfg, "max_position_embeddings", where, types=(int,), ge=2),
            postnorm=postnorm,
            block_size=_block_size(cfg, where),
            lightning_norm_eps=float(get_key(cfg, "lightning_norm_eps", where, default=1e-6, types=(int, float), gt=0)),
            tie_word_embeddings=False,
            hidden_act=act,
            eos_token_id=eos,
            bos_token_id=cfg.get("bos_token_id"),
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            **factors,
        )


def _layer_types(cfg: dict, num_layers: int, where: str) -> list[str]:
    """Accept ``layer_types`` (strings), ``attn_type_list`` or ``decoder_attention_types`` (0/1)."""
    present = [k for k in ("layer_types", "attn_type_list", "decoder_attention_types") if cfg.get(k) is not None]
    if not present:
        raise ConfigError(
            f"{where}: the layer types are missing: give 'layer_types' (HF-native) or 'attn_type_list' (original)"
        )
    key = present[0]
    raw = cfg[key]
    if not isinstance(raw, list):
        raise ConfigError(f"{where}: '{key}' must be a list, got {raw!r}")
    types = []
    for i, t in enumerate(raw):
        if t in (LINEAR, FULL):
            types.append(t)
        elif not isinstance(t, bool) and t in _TYPE_CODES:
            types.append(_TYPE_CODES[t])
        else:
            raise ConfigError(f"{where}: '{key}'[{i}] = {t!r}; expected 0/1 or 'linear_attention'/'full_attention'")
    if len(types) != num_layers:
        raise ConfigError(f"{where}: '{key}' has {len(types)} entries but num_hidden_layers is {num_layers}")
    for other in present[1:]:
        if _layer_types({other: cfg[other]}, num_layers, where) != types:
            raise ConfigError(f"{where}: '{key}' and '{other}' disagree")
    return types


def _either(cfg: dict, original: str, native: str, where: str) -> float:
    values = {k: cfg[k] for k in (original, native) if cfg.get(k) is not None}
    if not values:
        raise ConfigError(f"{where}: required key '{original}' (or HF-native '{native}') is missing")
    for k, v in values.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ConfigError(f"{where}: key '{k}' must be a number, got {v!r}")
    if len(set(float(v) for v in values.values())) > 1:
        raise ConfigError(f"{where}: '{original}'={values[original]} and '{native}'={values[native]} disagree")
    return float(next(iter(values.values())))


def _rotary_dim(cfg: dict, head_dim: int, where: str) -> int:
    """``rotary_dim`` (original) or ``partial_rotary_factor`` (top level or in ``rope_parameters``), applied once."""
    factor = cfg.get("partial_rotary_factor")
    if factor is None:
        factor = (cfg.get("rope_parameters") or {}).get("partial_rotary_factor")
    dims = []
    if cfg.get("rotary_dim") is not None:
        dims.append(("rotary_dim", get_key(cfg, "rotary_dim", where, types=(int,))))
    if factor is not None:
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
            raise ConfigError(f"{where}: partial_rotary_factor must be in (0, 1], got {factor!r}")
        dims.append(("partial_rotary_factor", int(head_dim * factor)))
    if not dims:
        raise ConfigError(
            f"{where}: required key 'rotary_dim' (original) or 'partial_rotary_factor' (HF-native) is missing; "
            "MiniMax rotates only part of each head, so there is no safe default"
        )
    if len(set(d for _, d in dims)) > 1:
        raise ConfigError(f"{where}: rotary_dim and head_dim * partial_rotary_factor disagree: {dims}")
    rotary = dims[0][1]
    if rotary <= 0 or rotary > head_dim or rotary % 2:
        raise ConfigError(f"{where}: rotary dim {rotary} must be even and in (0, head_dim={head_dim}]")
    return rotary


def _block_size(cfg: dict, where: str) -> int:
    for key in ("block_size", "block"):
        if cfg.get(key) is not None:
            value = get_key(cfg, key, where, types=(int,))
            if value < 1:
                raise ConfigError(f"{where}: '{key}' must be >= 1, got {value}")
            return value
    return DEFAULT_BLOCK_SIZE
