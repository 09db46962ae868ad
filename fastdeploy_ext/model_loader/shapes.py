"""The checkpoint tensor table's types, and the checks made with it before anything is allocated.

Each model declares its table in its own package (``models/<name>/weights.py``, registered as the spec's
``checkpoint``): every checkpoint tensor with its shape, split and role, and the parameter it fills. The model's
``load_weights`` routes tensors by it, the planner counts memory from it and the engine checks a checkpoint's
safetensors headers against it."""

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
    param: str = ""  # the model parameter it fills ("" = the same name)
    shard: str | None = None  # the part of a fused parameter it fills (q/k/v, gate/up/down)
    expert: int | None = None  # routed experts: the expert's index

    @property
    def target(self) -> str:
        return self.param or self.name


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
    ignored: tuple = ()  # name suffixes of checkpoint tensors the loader skips (recomputed buffers)


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
    from fastdeploy_ext.models.registry import checkpoint_shape, find_spec

    archs = raw.get("architectures") or ["?"]
    if not (isinstance(archs, list) and isinstance(archs[0], str) and find_spec(archs[0])):
        return None
    if max_tensors is not None and implied_tensor_count(raw) > max_tensors:
        raise ValueError(f"config.json implies at least {implied_tensor_count(raw):,} tensors (its layer and expert "
                         f"counts), more than the {max_tensors:,} allowed")
    return {t.name: t.shape for t in checkpoint_shape(raw).tensors}


# Paddle creates parameters from int32 shape entries: a dimension of 2**31 or more is an IndexError deep in Paddle.
MAX_DIM = 2**31 - 1


def check_dims(expected: dict[str, tuple]) -> None:
    """ValueError naming the first implied tensor with a dimension Paddle cannot index (2**31 or more)."""
    for name, shape in expected.items():
        if any(d > MAX_DIM for d in shape):
            raise ValueError(f"config.json implies '{name}' of shape {list(shape)}: a dimension of 2**31 or more "
                             "(Paddle indexes shapes with int32)")
