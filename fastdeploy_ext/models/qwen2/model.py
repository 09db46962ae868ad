"""Qwen2 decoder (GQA, qkv bias, NeoX RoPE, SwiGLU MLP); also MiDashengLM's text decoder."""

from __future__ import annotations

import numpy as np
import paddle
from paddle import nn

from fastdeploy_ext.models.qwen2.config import Qwen2Config
from fastdeploy_ext.layers.activation import SiluAndMul
from fastdeploy_ext.layers.attention import Attention
from fastdeploy_ext.layers.backend import backend_for
from fastdeploy_ext.layers.embeddings import ParallelLMHead, VocabParallelEmbedding, tied_lm_logits
from fastdeploy_ext.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from fastdeploy_ext.layers.normalization import RMSNorm
from fastdeploy_ext.layers.rotary_embedding import get_rope
from fastdeploy_ext.layers.utils import WeightLoadError, as_float32
from fastdeploy_ext.models.base import KVCacheSpec, ModelForCausalLM, load_weights_by_table
from fastdeploy_ext.models.qwen2.weights import QWEN2_IGNORED, qwen2_tensors

class Qwen2MLP(nn.Layer):
    def __init__(self, fd_config, cfg: Qwen2Config, prefix: str):
        super().__init__()
        self.up_gate_proj = MergedColumnParallelLinear(
            fd_config, f"{prefix}.up_gate_proj", cfg.hidden_size, [cfg.intermediate_size, cfg.intermediate_size]
        )
        self.down_proj = RowParallelLinear(fd_config, f"{prefix}.down_proj", cfg.intermediate_size, cfg.hidden_size)
        self.act_fn = SiluAndMul(fd_config)

    def forward(self, x):
        # swiglu splits the last dim in halves: silu(gate) * up, one kernel.
        return self.down_proj(self.act_fn(self.up_gate_proj(x)))


class Qwen2Attention(nn.Layer):
    def __init__(self, fd_config, cfg: Qwen2Config, layer_id: int, rotary_emb, prefix: str):
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            fd_config, f"{prefix}.qkv_proj", cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim, with_bias=True,
        )
        self.o_proj = RowParallelLinear(
            fd_config, f"{prefix}.o_proj", cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size
        )
        self.num_heads = self.qkv_proj.num_heads_per_rank
        self.num_kv_heads = self.qkv_proj.kv_heads_per_rank
        self.head_dim = cfg.head_dim
        self.rotary_emb = rotary_emb
        self.attn = Attention(fd_config, self.num_heads, self.num_kv_heads, cfg.head_dim, kv_cache_index=layer_id,
                              prefix=f"{prefix}.attn")

    def forward(self, hidden, forward_meta, output_only: bool = False):
        qkv = self.qkv_proj(hidden)
        return self.o_proj(self.attn(qkv=qkv, rotary_emb=self.rotary_emb, forward_meta=forward_meta,
                                     output_only=output_only))


class Qwen2DecoderLayer(nn.Layer):
    def __init__(self, fd_config, cfg: Qwen2Config, layer_id: int, rotary_emb, prefix: str):
        super().__init__()
        self.input_layernorm = RMSNorm(fd_config, cfg.hidden_size, cfg.rms_norm_eps, f"{prefix}.input_layernorm")
        self.self_attn = Qwen2Attention(fd_config, cfg, layer_id, rotary_emb, f"{prefix}.self_attn")
        self.post_attention_layernorm = RMSNorm(
            fd_config, cfg.hidden_size, cfg.rms_norm_eps, f"{prefix}.post_attention_layernorm"
        )
        self.mlp = Qwen2MLP(fd_config, cfg, f"{prefix}.mlp")

    def forward(self, hidden, residual, forward_meta, output_only: bool = False):
        """With ``output_only`` (the last layer, ``forward_meta.output_rows`` set) every token's k/v is
        cached, then only the output rows go on through attention, the residual and the MLP."""
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, forward_meta, output_only)
        if output_only:
            residual = paddle.gather(residual, forward_meta.attn_metadata.output_rows_tensor)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class Qwen2Model(nn.Layer):
    def __init__(self, fd_config, cfg: Qwen2Config, prefix: str = "model"):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = VocabParallelEmbedding(fd_config, cfg.vocab_size, cfg.hidden_size, f"{prefix}.embed_tokens")
        max_len = fd_config.scheduler_config.max_model_len
        # One table for all layers: it is a constant of (head_dim, theta, max_model_len).
        rope = get_rope(cfg.head_dim, max_len, cfg.rope_theta, fd_config=fd_config)
        self.layers = nn.LayerList(
            [Qwen2DecoderLayer(fd_config, cfg, i, rope, f"{prefix}.layers.{i}") for i in range(cfg.num_hidden_layers)]
        )
        self.norm = RMSNorm(fd_config, cfg.hidden_size, cfg.rms_norm_eps, f"{prefix}.norm")
        # Results made inside live until the next pass; the final norm's, which the caller keeps, are made outside.
        self.scratch = backend_for(fd_config).step_scratch()

    def forward(self, ids_remove_padding, forward_meta, inputs_embeds=None):
        hidden = self.embed_tokens(ids_remove_padding) if inputs_embeds is None else inputs_embeds
        residual = None
        last = len(self.layers) - 1 if forward_meta.output_rows is not None else -1
        with self.scratch:
            for i, layer in enumerate(self.layers):
                hidden, residual = layer(hidden, residual, forward_meta, output_only=i == last)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class Qwen2ForCausalLM(ModelForCausalLM):
    config_class = Qwen2Config
    # Fused parameter -> checkpoint projections (quantization skip lists name the latter).
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "up_gate_proj": ["gate_proj", "up_proj"]}
    selects_output_rows = True

    def __init__(self, fd_config):
        super().__init__(fd_config)
        cfg: Qwen2Config = fd_config.model_config
        self.cfg = cfg
        self.model = Qwen2Model(fd_config, cfg, prefix="model")
        self.lm_head = None if cfg.tie_word_embeddings else ParallelLMHead(fd_config, cfg.hidden_size, cfg.vocab_size, "lm_head")

    @classmethod
    def name(cls) -> str:
        return "Qwen2ForCausalLM"

    def forward(self, ids_remove_padding, forward_meta, inputs_embeds=None):
        return self.model(ids_remove_padding, forward_meta, inputs_embeds)

    def compute_logits(self, hidden):
        if self.lm_head is None:
            return tied_lm_logits(self.model.embed_tokens, hidden, self.fd_config)
        return self.lm_head(hidden)

    def kv_cache_spec(self):
        attn = self.model.layers[0].self_attn
        return [KVCacheSpec(attn.num_kv_heads, attn.head_dim)] * self.cfg.num_hidden_layers

    def load_weights(self, weights) -> set:
        weights = _check_tied_head(weights, self.cfg.tie_word_embeddings, "lm_head.weight", "model.embed_tokens.weight")
        table = qwen2_tensors(self.cfg, head=None if self.cfg.tie_word_embeddings else "lm_head.weight")
        return load_weights_by_table(self, weights, table, ignore=QWEN2_IGNORED)


def _check_tied_head(weights, tied: bool, head_name: str, embed_name: str):
    """With tied embeddings a stored head is accepted only if it equals the embedding (some exporters
    write both); otherwise the config and the checkpoint disagree, which is an error."""
    if not tied:
        yield from weights
        return
    head = embed = None
    for name, w in weights:
        if name == head_name:
            head = w
            continue
        if name == embed_name:
            embed = w
        yield name, w
    if head is not None:
        if embed is None or not np.array_equal(as_float32(head[:]), as_float32(embed[:])):
            raise WeightLoadError(
                f"config.json sets tie_word_embeddings=true but the checkpoint's '{head_name}' differs from '{embed_name}'"
            )
