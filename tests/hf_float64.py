"""OURS, test-only: an HF transformers float64 oracle without transformers' internal float32 casts.

transformers computes a few things in float32 whatever the model dtype. Read in the installed 5.24
``models/qwen2/modeling_qwen2.py`` and ``models/minimax/modeling_minimax.py``:

- RMSNorm statistics: ``Qwen2RMSNorm.forward`` / ``MiniMaxRMSNorm.forward`` do ``hidden_states.to(torch.float32)``;
- rotary tables: ``*RotaryEmbedding.compute_default_rope_parameters`` builds ``inv_freq`` from
  ``torch.arange(..., dtype=torch.float)``, and ``forward`` multiplies ``position_ids.float()`` by
  ``inv_freq.to(dtype=torch.float)`` (cos/sin in float32, cast to the model dtype only at the end);
- eager softmax: ``eager_attention_forward`` calls ``softmax(attn_weights, dim=-1, dtype=torch.float32)``;
- MoE router softmax: ``MiniMaxTopKRouter.forward`` calls ``softmax(router_logits.float(), dim=-1)``;
- the tests' own log-softmax helpers (``tests/oracle.py hf_logprobs``, ``align.oracle_logprobs``) do ``.float()``.

Not a cast but a refusal: MiniMax's default experts implementation (``torch._grouped_mm``) takes no float64, so
:func:`load_minimax` selects the eager experts loop (``config._experts_implementation = "eager"``, same math).

- MiniMax lightning decays: ``_init_weights`` fills the ``slope_rate`` / ``*_decay`` buffers from ``get_slope_rate()``
  computed in the default dtype (float32). :func:`load_minimax` rebuilds them in float64, with MiniMax's own slope
  factor ``1 - l/(L-1) + 1e-5`` (the package's, the original code's and vLLM's) in place of transformers'
  ``1 - l/(L-1+1e-5) + 1e-5``, which differs by up to 1e-5 relative and would alone fail a 1e-9 comparison.

:func:`hf_float64` is a context manager that replaces those functions/forwards with versions computing in
``max(float32, input dtype)``: for float32 (or bf16) inputs they are the stock code's math, for float64 inputs they
stay in float64. The rotary forward recomputes ``inv_freq`` in float64 from ``rope_theta`` and the width of the stored
table (``2 * len(inv_freq)``: the MiniMax oracle's partial-RoPE table is ``r/2`` long) and asserts the stored table
equals it to float32 rounding, so the patch cannot change which frequencies are used. Only ``rope_type: default`` is
handled (an assertion says so otherwise).

tests/models/test_device_backend.py shows the patch is live (stock and patched float64 logits differ by more than 1e-8) and
leaves the math alone (patched float64 agrees with stock float32 to float32 rounding).
"""

from __future__ import annotations

import contextlib
import json
import os

import numpy as np

RMSNORM_CLASSES = (("qwen2", "Qwen2RMSNorm"), ("minimax", "MiniMaxRMSNorm"))
ROTARY_CLASSES = (("qwen2", "Qwen2RotaryEmbedding"), ("minimax", "MiniMaxRotaryEmbedding"))
EAGER_MODULES = ("qwen2", "minimax")


def _acc(torch, dtype):
    """max(float32, dtype): what the stock code computes in for float32/bf16/fp16, float64 for float64."""
    return torch.promote_types(dtype, torch.float32)


def _modeling(name):
    import importlib

    return importlib.import_module(f"transformers.models.{name}.modeling_{name}")


def _rms_norm_forward(self, hidden_states):
    import torch

    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(_acc(torch, input_dtype))  # stock: .to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden_states.to(input_dtype)


def _rotary_forward(stock):
    def forward(self, x, position_ids):
        import torch

        if x.dtype != torch.float64:
            return stock(self, x, position_ids)
        assert self.rope_type == "default" and self.attention_scaling == 1.0, (self.rope_type, self.attention_scaling)
        rope = self.config.rope_parameters
        theta = rope["rope_theta"]
        width = 2 * self.inv_freq.shape[0]
        inv_freq = 1.0 / (theta ** (torch.arange(0, width, 2, dtype=torch.float64) / width))
        np.testing.assert_allclose(self.inv_freq.double().numpy(), inv_freq.numpy(), rtol=2e-7, atol=0)
        freqs = position_ids[..., None].to(torch.float64) * inv_freq.to(x.device)  # stock: .float() * inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    return forward


def _eager_attention_forward(module_name):
    def eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        import torch
        from torch import nn

        repeat_kv = _modeling(module_name).repeat_kv
        key_states = repeat_kv(key, module.num_key_value_groups)
        value_states = repeat_kv(value, module.num_key_value_groups)
        attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        # stock: softmax(..., dtype=torch.float32)
        attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=_acc(torch, query.dtype)).to(query.dtype)
        attn_weights = nn.functional.dropout(attn_weights, p=dropout, training=module.training)
        attn_output = torch.matmul(attn_weights, value_states)
        return attn_output.transpose(1, 2).contiguous(), attn_weights

    return eager_attention_forward


def _router_forward(self, hidden_states):
    import torch

    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = torch.nn.functional.linear(hidden_states, self.weight)
    # stock: softmax(router_logits.float(), dim=-1)
    router_probs = torch.nn.functional.softmax(router_logits.to(_acc(torch, router_logits.dtype)), dim=-1)
    router_top_value, router_indices = torch.topk(router_probs, self.top_k, dim=-1)
    router_top_value /= router_top_value.sum(dim=-1, keepdim=True)
    return router_logits, router_top_value, router_indices


@contextlib.contextmanager
def hf_float64():
    """Within the block, HF Qwen2 / MiniMax compute RMSNorm statistics, rotary tables, eager softmax and the MoE
    router softmax in max(float32, model dtype). Restores the stock functions on exit."""
    saved = []

    def patch(owner, name, value):
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    try:
        for mod, cls in RMSNORM_CLASSES:
            patch(getattr(_modeling(mod), cls), "forward", _rms_norm_forward)
        for mod, cls in ROTARY_CLASSES:
            klass = getattr(_modeling(mod), cls)
            patch(klass, "forward", _rotary_forward(klass.forward))
        for mod in EAGER_MODULES:
            # Attention modules look the eager function up in their module's globals at call time.
            patch(_modeling(mod), "eager_attention_forward", _eager_attention_forward(mod))
        patch(_modeling("minimax").MiniMaxTopKRouter, "forward", _router_forward)
        yield
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)


def logprobs(model, token_ids=None, inputs_embeds=None) -> np.ndarray:
    """Teacher-forced log-softmax ``[T, V]`` of an HF causal LM in the model's own dtype (float64 for a float64
    model: no ``.float()``), positions 0..T-1 explicit (row i predicts token i+1)."""
    import torch

    with torch.no_grad():
        if inputs_embeds is None:
            inputs = {"input_ids": torch.tensor([list(token_ids)])}
        else:
            inputs = {"inputs_embeds": inputs_embeds}
        length = next(iter(inputs.values())).shape[1]
        logits = model(**inputs, position_ids=torch.arange(length)[None]).logits[0]
        return torch.log_softmax(logits, dim=-1).numpy()


# ---------------------------------------------------------------- float64 oracles of the three models


def load_qwen2(path: str, dtype="float64"):
    """Eager ``transformers.Qwen2ForCausalLM`` in ``dtype`` (a torch dtype name)."""
    import torch
    import transformers

    return transformers.Qwen2ForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype),
                                                         attn_implementation="eager").eval()


def load_minimax(path: str, dtype="float64"):
    """The MiniMax oracle of ``fastdeploy_ext.models.minimax_m1.align`` (partial RoPE patched in), in ``dtype``; the
    lightning decay buffers checked to be in it."""
    import torch
    import transformers
    from transformers.models.minimax import modeling_minimax

    from fastdeploy_ext.models.minimax_m1.align import _partial_apply_rotary_pos_emb, hf_minimax_config

    with open(os.path.join(path, "config.json")) as f:
        cfg = hf_minimax_config(json.load(f))
    td = getattr(torch, dtype)
    model = transformers.MiniMaxForCausalLM.from_pretrained(path, config=cfg, dtype=td,
                                                            attn_implementation="eager").eval()
    r, theta = cfg.oracle_rotary_dim, cfg.rope_parameters["rope_theta"]
    inv_freq = 1.0 / (theta ** (torch.arange(0, r, 2, dtype=torch.float) / r))  # as load_minimax_oracle
    rope = model.model.rotary_emb
    rope.inv_freq = inv_freq
    rope.original_inv_freq = inv_freq.clone()
    modeling_minimax.apply_rotary_pos_emb = _partial_apply_rotary_pos_emb
    # The default experts implementation (torch._grouped_mm) takes float32/bf16/fp16 only; the eager one is the
    # per-expert loop in the model file (same math).
    model.config._experts_implementation = "eager"
    if td == torch.float64:
        _float64_lightning_decays(model, cfg)
    return model


def _float64_lightning_decays(model, cfg) -> None:
    """Rebuild every lightning layer's ``slope_rate`` / ``query_decay`` / ``key_decay`` / ``diagonal_decay`` buffers in
    float64 (OURS). transformers fills them in ``_init_weights`` from ``get_slope_rate()``, computed in the default
    dtype (float32) and copied into the float64 buffers: 1.4e-8 relative error. The slope's layer factor is MiniMax's
    definition, ``1 - l/(L-1) + 1e-5`` (minimax_m1.md §3.2; the original remote code and vLLM), where transformers
    writes ``1 - l/(L-1+1e-5) + 1e-5`` (a relative difference up to 1e-5, visible only in float64). The decays are then
    HF's own ``decay_factors`` of those slopes."""
    import torch
    from transformers.models.minimax.modeling_minimax import MiniMaxLightningAttention

    n_layers = cfg.num_hidden_layers
    for layer in model.model.layers:
        attn = layer.self_attn
        if not isinstance(attn, MiniMaxLightningAttention):
            continue
        h = attn.num_attention_heads
        base = 1 / (2 ** (8 / h))
        rate = base ** torch.arange(1, h + 1, dtype=torch.float64) * (1 - attn.layer_idx / (n_layers - 1) + 1e-5)
        slope = rate[:, None, None]
        with torch.no_grad():
            for buf, value in zip((attn.slope_rate, attn.query_decay, attn.key_decay, attn.diagonal_decay),
                                  (slope, *attn.decay_factors(slope))):
                assert buf.dtype == value.dtype == torch.float64 and buf.shape == value.shape
                buf.copy_(value)


class MiDashengLMFloat64Oracle:
    """The composite MiDashengLM oracle (``models.midashenglm.align.MiDashengLMOracle``: dasheng encoder + torch projector + HF Qwen2)
    in float64, with the log-mel frontend taken from librosa in float64 (spec midashenglm.md §10: STFT with reflect
    padding, HTK mel without norm built in float64, ``power_to_db(top_db=120)`` per clip) instead of the package's frontend."""

    def __init__(self, model_dir: str):
        from fastdeploy_ext.models.midashenglm.align import MiDashengLMOracle

        base = MiDashengLMOracle(model_dir)
        self.encoder = base.encoder.double()
        self.projector = {k: v.double() for k, v in base.projector.items()}
        self.decoder = base.decoder.double()

    @staticmethod
    def log_mel(wave: np.ndarray) -> np.ndarray:
        """librosa in float64 throughout: ``librosa.feature.melspectrogram`` would build its filterbank with
        ``librosa.filters.mel``'s default ``dtype=np.float32``, so the steps are spelled out with ``dtype=np.float64``."""
        import librosa

        y = np.asarray(wave, np.float64)
        spec = librosa.stft(y, n_fft=512, hop_length=160, win_length=512, window="hann", center=True, pad_mode="reflect")
        assert spec.dtype == np.complex128
        fb = librosa.filters.mel(sr=16000, n_fft=512, n_mels=64, fmin=0.0, fmax=8000.0, htk=True, norm=None,
                                 dtype=np.float64)
        return librosa.power_to_db(fb @ np.abs(spec) ** 2, ref=1.0, amin=1e-10, top_db=120.0)

    def audio_rows(self, wave: np.ndarray):
        import torch

        from fastdeploy_ext.models.midashenglm.align import _expected_audio_tokens

        with torch.no_grad():
            wave = np.pad(wave, (0, max(0, 3200 - wave.shape[0])))
            features = torch.from_numpy(self.log_mel(wave)[None])
            hidden = self.encoder.forward_spectrogram(self.encoder.init_bn(features[:, None]),
                                                      x_length=torch.tensor([wave.shape[0]]))
            groups = hidden.shape[1] // 5
            stacked = hidden[:, : groups * 5].reshape(1, groups, -1)
            p, f = self.projector, torch.nn.functional
            out = f.linear(f.gelu(f.linear(stacked, p["0.weight"], p["0.bias"])), p["2.weight"], p["2.bias"])
            return out[0, : _expected_audio_tokens(wave.shape[0])]

    def logprobs(self, ids, audio_positions, rows) -> np.ndarray:
        import torch

        with torch.no_grad():
            embeds = self.decoder.model.embed_tokens(torch.tensor([list(ids)]))
            if len(audio_positions):
                embeds[0, torch.as_tensor(audio_positions, dtype=torch.long)] = rows
        return logprobs(self.decoder, inputs_embeds=embeds)


def text_oracle(model_dir: str, dtype: str):
    """``ids -> log-softmax rows [len(ids), V]`` of the checkpoint's HF oracle: in float32 the project's usual one
    (``load_qwen2_oracle`` / ``load_minimax_oracle`` of the model packages, fp32 log-softmax), in float64 the patched float64
    model under :func:`hf_float64`."""
    from fastdeploy_ext.entrypoints import align
    from fastdeploy_ext.models.minimax_m1.align import load_minimax_oracle
    from fastdeploy_ext.models.qwen2.align import load_qwen2_oracle

    with open(os.path.join(model_dir, "config.json")) as f:
        arch = json.load(f)["architectures"][0]
    qwen = arch == "Qwen2ForCausalLM"
    if dtype == "float32":
        model = load_qwen2_oracle(model_dir) if qwen else load_minimax_oracle(model_dir)
        return lambda ids: align.oracle_logprobs(model, ids)
    if dtype != "float64":
        raise ValueError(f"dtype must be float32 or float64, got {dtype!r}")
    model = load_qwen2(model_dir) if qwen else load_minimax(model_dir)

    def run(ids):
        with hf_float64():
            return logprobs(model, ids)

    return run
