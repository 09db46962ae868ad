"""MiniMax-M1 / MiniMax-Text-01: hybrid decoder of lightning (linear) attention layers and GQA softmax
layers with partial NeoX RoPE, every layer followed by a top-k SwiGLU MoE, DeepNorm residuals.

Caches: paged KV only for the softmax layers (compact ``kv_cache_index`` 0..n_full-1); one recurrent state
``[H/tp, D, D]`` (max(float32, compute dtype)) per lightning layer and sequence in the runner's state pool. Math and checkpoint
names: docs/models/minimax_m1.md.
"""

from __future__ import annotations

import re

from paddle import nn

from fastdeploy_ext.models.minimax_m1.config import LINEAR, MiniMaxM1Config
from fastdeploy_ext.layers.attention import Attention
from fastdeploy_ext.layers.embeddings import ParallelLMHead, VocabParallelEmbedding
from fastdeploy_ext.layers.linear import QKVParallelLinear, ReplicatedLinear, RowParallelLinear
from fastdeploy_ext.layers.linear_attention import LinearAttention
from fastdeploy_ext.layers.moe import FusedMoE
from fastdeploy_ext.layers.normalization import RMSNorm
from fastdeploy_ext.layers.rotary_embedding import get_rope
from fastdeploy_ext.layers.backend import accum_dtype, backend_for
from fastdeploy_ext.layers.residual import ScaledResidual
from fastdeploy_ext.layers.utils import WeightLoadError, default_weight_loader, shape_of
from fastdeploy_ext.model_loader import check_all_loaded
from fastdeploy_ext.models.base import KVCacheSpec, ModelForCausalLM, StateCacheSpec, TensorRoutes
from fastdeploy_ext.models.minimax_m1.weights import MINIMAX_IGNORED, STACKED_DOWN, STACKED_GATE_UP, minimax_tensors
from fastdeploy_ext.quantization.methods import check_components_complete


class MiniMaxM1MoE(nn.Layer):
    """Router (fp32, replicated) + routed experts; the experts all-reduce their output once."""

    def __init__(self, fd_config, cfg: MiniMaxM1Config, prefix: str):
        super().__init__()
        self.gate = ReplicatedLinear(fd_config, f"{prefix}.gate", cfg.hidden_size, cfg.num_local_experts,
                                     weight_dtype=accum_dtype(fd_config))
        self.experts = FusedMoE(fd_config, cfg.hidden_size, cfg.intermediate_size, cfg.num_local_experts,
                                cfg.num_experts_per_tok, renormalize=True, prefix=f"{prefix}.experts")

    def forward(self, x):
        return self.experts(x, self.gate)


class MiniMaxM1Attention(nn.Layer):
    """GQA softmax attention with partial RoPE over the paged cache ``kv_cache_index``."""

    def __init__(self, fd_config, cfg: MiniMaxM1Config, kv_cache_index: int, rotary_emb, prefix: str):
        super().__init__()
        self.qkv_proj = QKVParallelLinear(fd_config, f"{prefix}.qkv_proj", cfg.hidden_size, cfg.num_attention_heads,
                                          cfg.num_key_value_heads, cfg.head_dim)
        self.o_proj = RowParallelLinear(fd_config, f"{prefix}.o_proj", cfg.num_attention_heads * cfg.head_dim,
                                        cfg.hidden_size)
        self.num_heads = self.qkv_proj.num_heads_per_rank
        self.num_kv_heads = self.qkv_proj.kv_heads_per_rank
        self.head_dim = cfg.head_dim
        self.rotary_emb = rotary_emb
        self.attn = Attention(fd_config, self.num_heads, self.num_kv_heads, cfg.head_dim, kv_cache_index=kv_cache_index,
                              prefix=f"{prefix}.attn")

    def forward(self, hidden, forward_meta):
        qkv = self.qkv_proj(hidden)
        return self.o_proj(self.attn(qkv=qkv, rotary_emb=self.rotary_emb, forward_meta=forward_meta))


class MiniMaxM1DecoderLayer(nn.Layer):
    """DeepNorm residual (docs/models/minimax_m1.md). With ``postnorm`` (every released checkpoint) the
    residual carried is the normed tensor::

        a = norm_in(x);  h = alpha_attn * a + beta_attn * attn(a)
        b = norm_post(h); y = alpha_mlp * b + beta_mlp * moe(b)

    without it, the un-normed input (``x``, then ``h``) is carried instead.
    """

    def __init__(self, fd_config, cfg: MiniMaxM1Config, layer_id: int, cache_index: int, rotary_emb, prefix: str):
        super().__init__()
        self.is_linear = cfg.layer_types[layer_id] == LINEAR
        self.postnorm = cfg.postnorm
        attn_alpha, attn_beta, mlp_alpha, mlp_beta = cfg.residual_factors(layer_id)
        self.attn_residual = ScaledResidual(fd_config, attn_alpha, attn_beta)
        self.mlp_residual = ScaledResidual(fd_config, mlp_alpha, mlp_beta)
        self.input_layernorm = RMSNorm(fd_config, cfg.hidden_size, cfg.rms_norm_eps, f"{prefix}.input_layernorm")
        if self.is_linear:
            self.self_attn = LinearAttention(
                fd_config, cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, layer_id, cfg.num_hidden_layers,
                state_index=cache_index, norm_eps=cfg.lightning_norm_eps, block_size=cfg.block_size,
                prefix=f"{prefix}.self_attn",
            )
        else:
            self.self_attn = MiniMaxM1Attention(fd_config, cfg, cache_index, rotary_emb, f"{prefix}.self_attn")
        self.post_attention_layernorm = RMSNorm(fd_config, cfg.hidden_size, cfg.rms_norm_eps,
                                                f"{prefix}.post_attention_layernorm")
        self.block_sparse_moe = MiniMaxM1MoE(fd_config, cfg, f"{prefix}.block_sparse_moe")

    def forward(self, x, forward_meta):
        """``x`` ``[T, hidden]`` → ``[T, hidden]``."""
        a, _ = self.input_layernorm(x)
        attn = self.self_attn(a, forward_meta)
        h = self.attn_residual(a if self.postnorm else x, attn)
        b, _ = self.post_attention_layernorm(h)
        return self.mlp_residual(b if self.postnorm else h, self.block_sparse_moe(b))


class MiniMaxM1Model(nn.Layer):
    def __init__(self, fd_config, cfg: MiniMaxM1Config, prefix: str = "model"):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = VocabParallelEmbedding(fd_config, cfg.vocab_size, cfg.hidden_size, f"{prefix}.embed_tokens")
        # NeoX pairing (i, i + rotary_dim/2) on the leading rotary_dim channels, ladder over rotary_dim.
        rope = get_rope(cfg.head_dim, fd_config.scheduler_config.max_model_len, cfg.rope_theta,
                        rotary_dim=cfg.rotary_dim, style="neox", fd_config=fd_config)
        layers, n_linear, n_full = [], 0, 0
        for i, kind in enumerate(cfg.layer_types):
            # Compact cache indices: state pool ordinal for lightning layers, KV cache ordinal for GQA layers.
            index = n_linear if kind == LINEAR else n_full
            layers.append(MiniMaxM1DecoderLayer(fd_config, cfg, i, index, rope, f"{prefix}.layers.{i}"))
            n_linear, n_full = n_linear + (kind == LINEAR), n_full + (kind != LINEAR)
        self.layers = nn.LayerList(layers)
        self.num_linear_layers = n_linear
        self.norm = RMSNorm(fd_config, cfg.hidden_size, cfg.rms_norm_eps, f"{prefix}.norm")
        # Results made inside live until the next pass; the final norm's, which the caller keeps, are made outside.
        self.scratch = backend_for(fd_config).step_scratch()

    def forward(self, ids_remove_padding, forward_meta):
        hidden = self.embed_tokens(ids_remove_padding)
        with self.scratch:
            for layer in self.layers:
                hidden = layer(hidden, forward_meta)
        hidden, _ = self.norm(hidden)
        return hidden


_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


class MiniMaxM1ForCausalLM(ModelForCausalLM):
    config_class = MiniMaxM1Config
    # The full-attention layers' fused qkv_proj packs q/k/v_proj (lightning layers store qkv_proj as is);
    # quantization skip lists name checkpoint modules.
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}

    def __init__(self, fd_config):
        super().__init__(fd_config)
        cfg: MiniMaxM1Config = fd_config.model_config
        self.cfg = cfg
        self.model = MiniMaxM1Model(fd_config, cfg, prefix="model")
        self.lm_head = ParallelLMHead(fd_config, cfg.hidden_size, cfg.vocab_size, "lm_head")

    @classmethod
    def name(cls) -> str:
        return "MiniMaxM1ForCausalLM"

    def forward(self, ids_remove_padding, forward_meta):
        return self.model(ids_remove_padding, forward_meta)

    def compute_logits(self, hidden):
        return self.lm_head(hidden)

    def kv_cache_spec(self):
        return [KVCacheSpec(layer.self_attn.num_kv_heads, layer.self_attn.head_dim)
                for layer in self.model.layers if not layer.is_linear]

    def state_cache_spec(self):
        if not self.model.num_linear_layers:
            return None
        attn = next(layer.self_attn for layer in self.model.layers if layer.is_linear)
        return StateCacheSpec(self.model.num_linear_layers, (attn.heads_per_rank, attn.head_dim, attn.head_dim),
                               attn.acc)

    def load_weights(self, weights) -> set:
        """Route every checkpoint tensor (either layout, fp32 or bf16) through the checkpoint table to one
        parameter's loader; raise on any tensor the table does not hold and on any parameter left (partly)
        unfilled. Returns loaded names."""
        params = dict(self.named_parameters())
        routes = TensorRoutes(minimax_tensors(self.cfg, stacked_experts=False)
                              + minimax_tensors(self.cfg, stacked_experts=True))
        loaded = set()
        for ckpt_name, tensor in weights:
            if any(ckpt_name == s or ckpt_name.endswith("." + s) for s in MINIMAX_IGNORED):
                continue
            try:
                t, name = routes.route(ckpt_name)
                if t is None or t.shard in (STACKED_GATE_UP, STACKED_DOWN) and ckpt_name != t.name:
                    raise WeightLoadError(self._unrouted(ckpt_name))
                if t.expert is not None:
                    self._load_expert(t, ckpt_name.rpartition(".")[2], tensor)
                elif t.shard in (STACKED_GATE_UP, STACKED_DOWN):
                    self._load_stacked(params[t.target], t, tensor)
                else:
                    param = params.get(name)
                    if param is None:
                        raise WeightLoadError(f"matches no model parameter (looked for '{name}')")
                    getattr(param, "weight_loader", default_weight_loader)(param, tensor, t.shard)
            except WeightLoadError as e:
                raise WeightLoadError(f"checkpoint tensor '{ckpt_name}': {e}") from None
            loaded.add(ckpt_name)
        check_components_complete(self)
        check_all_loaded(self)
        for layer in self.model.layers:
            layer.block_sparse_moe.experts.process_weights_after_loading()
        return loaded

    def _unrouted(self, ckpt_name: str) -> str:
        """Why the table holds no ``ckpt_name``: a fused ``qkv_proj`` exists in both layer types, but on disk only
        lightning layers carry it (head-major); a GQA layer's is assembled from q/k/v."""
        layer = _LAYER_RE.match(ckpt_name)
        if (layer and int(layer[1]) < len(self.model.layers) and not self.model.layers[int(layer[1])].is_linear
                and ".self_attn.qkv_proj." in ckpt_name):
            return f"layer {layer[1]} is a full-attention layer: expected q_proj/k_proj/v_proj, not a fused qkv_proj"
        return "matches no model parameter (not in the checkpoint table)"

    def _experts_of(self, t) -> FusedMoE:
        return self.model.layers[int(_LAYER_RE.match(t.name)[1])].block_sparse_moe.experts

    def _load_expert(self, t, part: str, tensor) -> None:
        """One expert's ``w1/w3/w2`` matrix, or in a pre-quantized checkpoint one of its components (GPTQ
        ``qweight``/``qzeros``/``scales``/``g_idx``, FP8 ``weight``/``weight_scale_inv``)."""
        param = self._experts_of(t).checkpoint_param(t.target.rpartition(".")[2], part)
        param.weight_loader(param, tensor, t.shard, t.expert)

    def _load_stacked(self, param, t, tensor) -> None:
        """HF-native ``gate_up_proj [E, 2I, H]`` (gate rows first, then up: transformers' MiniMaxExperts) or
        ``down_proj [E, H, I]``, one expert at a time without reading the whole tensor."""
        experts = self._experts_of(t)
        if experts.quant_method is not None and experts.quant_method.components:
            raise WeightLoadError("a stacked expert tensor in a pre-quantized checkpoint: only per-expert "
                                  "E.w1/w2/w3 tensors are supported there")
        _check_stacked(tensor, t.shape)
        inter, hidden = experts.intermediate_size, experts.hidden_size
        for i in range(experts.num_experts):
            if t.shard == STACKED_GATE_UP:
                experts.weight_loader(param, _ExpertRows(tensor, i, 0, inter), "gate", i)
                experts.weight_loader(param, _ExpertRows(tensor, i, inter, 2 * inter), "up", i)
            else:
                experts.weight_loader(param, _ExpertRows(tensor, i, 0, hidden), "down", i)


class MiniMaxText01ForCausalLM(MiniMaxM1ForCausalLM):
    @classmethod
    def name(cls) -> str:
        return "MiniMaxText01ForCausalLM"


class MiniMaxForCausalLM(MiniMaxM1ForCausalLM):
    """HF-native checkpoints (``model_type: minimax``)."""

    @classmethod
    def name(cls) -> str:
        return "MiniMaxForCausalLM"


def _check_stacked(tensor, want: tuple) -> None:
    if shape_of(tensor) != want:
        raise WeightLoadError(f"shape mismatch: checkpoint {list(shape_of(tensor))}, expected {list(want)}")


class _ExpertRows:
    """Rows ``[start, end)`` of expert ``expert`` in a stacked ``[E, rows, cols]`` checkpoint tensor, still lazy."""

    def __init__(self, source, expert: int, start: int, end: int):
        self.source, self.expert, self.start, self.end = source, expert, start, end
        self.shape = (end - start, shape_of(source)[2])

    def __getitem__(self, idx):
        idx = idx if isinstance(idx, tuple) else (idx,)
        rows, cols = idx[0], idx[1] if len(idx) > 1 else slice(None)
        if not isinstance(rows, slice) or rows.step not in (None, 1):
            raise TypeError("_ExpertRows supports contiguous row slices only")
        n = self.end - self.start
        lo = self.start + (rows.start or 0)
        hi = self.start + (n if rows.stop is None else min(rows.stop, n))
        return self.source[self.expert:self.expert + 1, lo:hi, cols][0]
