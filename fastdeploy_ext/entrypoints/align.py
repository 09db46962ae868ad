"""Layer-by-layer alignment against a reference we did not write (``fastdeploy-ext align``), and the oracles the
tests share.

Both sides run one teacher-forced prefill of the same prompt (token ids and, for MiDashengLM, waveforms) in fp32
on CPU. Compared rows, each ``[T, hidden]`` over all prompt positions:

- ``embed``: the decoder's input embeddings (for MiDashengLM with the audio rows scattered in, so a diverging
  encoder or projector shows up here); HF's ``output_hidden_states[0]``.
- ``0 .. L-1``: each decoder layer's output, i.e. the hidden state the next layer reads. For MiniMax's post-norm
  DeepNorm layers that is ``alpha * norm(h) + beta * moe(norm(h))`` (the layer's return value on both sides). For
  Qwen2 our layers return ``(mlp_out, residual)`` because the residual add is fused into the next norm; the
  compared tensor is their sum, which is what HF's layer returns.
- ``norm``: the final RMSNorm's output.

HF's layer outputs are taken with forward hooks, not from ``output_hidden_states[i + 1]``: transformers 5 stores the
*normed* final state as ``hidden_states[-1]``, so indexing would blame a correct last layer.

References: Qwen2 → transformers ``Qwen2ForCausalLM``; MiniMax (``MiniMaxM1ForCausalLM``,
``MiniMaxText01ForCausalLM``, ``MiniMaxForCausalLM``) → transformers ``MiniMaxForCausalLM`` with its RoPE patched to
MiniMax's partial rotation (spec minimax_m1.md §10; unpatched, it rotates the whole head and blames every correct
full-attention layer); MiDashengLM → the PyPI ``dasheng`` encoder + the projector in torch + transformers Qwen2
(spec midashenglm.md §10). torch, transformers, dasheng and matplotlib are imported inside functions: the package
works without the ``align`` extra, and :func:`require_align_extra` turns their absence into a clear message.
"""

from __future__ import annotations

import importlib
import json
import os
from dataclasses import dataclass

import numpy as np

# Relative error above which a row counts as diverging. fp32 on both sides gives ~1e-6 per op; a tiny model's
# layers measure <= 1e-6 and a real model's deeper stack a few 1e-5, so 1e-4 only trips on a real difference.
DEFAULT_THRESHOLD = 1e-4

INSTALL_HINT = 'pip install -e ".[align]"'

MINIMAX_ARCHS = ("MiniMaxM1ForCausalLM", "MiniMaxText01ForCausalLM", "MiniMaxForCausalLM")
SUPPORTED_ARCHS = ("Qwen2ForCausalLM",) + MINIMAX_ARCHS + ("MiDashengLMModel",)


class MissingExtraError(RuntimeError):
    """An optional dependency of the alignment tooling is not importable; the message says what to install."""


def require_align_extra(*, dasheng: bool = False, plot: bool = False) -> None:
    """Import torch and transformers (plus dasheng / matplotlib when asked); raise :class:`MissingExtraError`
    naming the install command for the first one that fails."""
    needed = ["torch", "transformers"] + (["matplotlib"] if plot else [])
    for name in needed:
        try:
            importlib.import_module(name)
        except (ImportError, OSError) as e:
            raise MissingExtraError(f"fastdeploy-ext align needs {name}, which cannot be imported ({e}); "
                                    f"install the align extra: {INSTALL_HINT}") from None
    if dasheng:
        import_dasheng()


def import_dasheng():
    """``dasheng.pretrained.pretrained`` or :class:`MissingExtraError`.

    dasheng pulls torchaudio, whose C extensions may be built for another torch (spec midashenglm.md §10: the
    torchaudio 2.11 wheel against torch 2.13+cpu fails with ``libc10_cuda.so`` missing). The fix edits the
    installed torchaudio, so it is explained rather than applied here.
    """
    try:
        from dasheng.pretrained import pretrained
    except (ImportError, OSError) as e:
        raise MissingExtraError(
            f"MiDashengLM alignment needs dasheng, which cannot be imported ({e}): {INSTALL_HINT} (it includes dasheng==0.0.9). "
            "If dasheng is installed and torchaudio's C extensions were built for another torch, install a matching "
            "torch/torchaudio pair or delete _torchaudio*.so, libtorchaudio*.so and torchaudio_prefixctc*.so from "
            "torchaudio/lib (torchaudio then runs in pure Python; specs/midashenglm.md §10)") from None
    return pretrained


# ---------------------------------------------------------------- MiniMax: HF with partial RoPE


def _partial_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    """NeoX rotate-half on the leading ``r = cos.shape[-1]`` channels; the rest passes through (r = head_dim is
    transformers' own function)."""
    import torch
    from transformers.models.minimax import modeling_minimax

    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    r = cos.shape[-1]

    def rotate(x):
        rot, rest = x[..., :r], x[..., r:]
        return torch.cat([rot * cos + modeling_minimax.rotate_half(rot) * sin, rest], dim=-1)

    return rotate(q), rotate(k)


def hf_minimax_config(raw: dict):
    """``transformers.MiniMaxConfig`` from a raw config.json of either format, mapped explicitly here (HF ignores the
    legacy keys) so that a parsing bug in the package does not leak into the oracle. The rotary width is attached
    as ``oracle_rotary_dim``."""
    import transformers

    if "attn_type_list" in raw:
        layer_types = ["full_attention" if t == 1 else "linear_attention" for t in raw["attn_type_list"]]
        factors = {f"{native}_{s}_factor": raw[f"layernorm_{orig}_{s}"]
                   for native, orig in (("linear_attn", "linear_attention"), ("full_attn", "full_attention"), ("mlp", "mlp"))
                   for s in ("alpha", "beta")}
        rotary_dim, theta, block = raw["rotary_dim"], raw["rope_theta"], raw.get("block", 256)
        if raw.get("postnorm") is not True:
            raise ValueError("transformers' MiniMax implements the post-norm residual only (config.json postnorm)")
    else:
        layer_types = raw["layer_types"]
        factors = {k: raw[k] for k in raw if k.endswith(("_alpha_factor", "_beta_factor"))}
        rotary_dim = int(raw["head_dim"] * raw["partial_rotary_factor"])
        theta, block = raw["rope_parameters"]["rope_theta"], raw["block_size"]
    cfg = transformers.MiniMaxConfig(
        vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"], intermediate_size=raw["intermediate_size"],
        num_hidden_layers=raw["num_hidden_layers"], num_attention_heads=raw["num_attention_heads"],
        num_key_value_heads=raw["num_key_value_heads"], head_dim=raw["head_dim"],
        num_local_experts=raw["num_local_experts"], num_experts_per_tok=raw["num_experts_per_tok"],
        max_position_embeddings=raw["max_position_embeddings"], rms_norm_eps=raw["rms_norm_eps"],
        layer_types=layer_types, block_size=block, rope_parameters={"rope_type": "default", "rope_theta": theta},
        tie_word_embeddings=False, **factors,
    )
    cfg.oracle_rotary_dim = rotary_dim
    return cfg


def load_minimax_oracle(path: str):
    """fp32 eager ``transformers.MiniMaxForCausalLM`` from the checkpoint at ``path``, RoPE patched to partial:
    ``inv_freq = 1/theta^((0,2,..,r-2)/r)`` and rotate-half on ``[..., :r]`` only."""
    import torch
    import transformers
    from transformers.models.minimax import modeling_minimax

    with open(os.path.join(path, "config.json")) as f:
        cfg = hf_minimax_config(json.load(f))
    model = transformers.MiniMaxForCausalLM.from_pretrained(path, config=cfg, dtype=torch.float32,
                                                            attn_implementation="eager").eval()
    r, theta = cfg.oracle_rotary_dim, cfg.rope_parameters["rope_theta"]
    inv_freq = 1.0 / (theta ** (torch.arange(0, r, 2, dtype=torch.float) / r))
    rope = model.model.rotary_emb
    rope.inv_freq = inv_freq
    rope.original_inv_freq = inv_freq.clone()
    # MiniMaxAttention.forward looks the function up in its module at call time. The patch is process-wide but
    # keyed on cos.shape[-1], so it equals transformers' function for any model left at full rotation.
    modeling_minimax.apply_rotary_pos_emb = _partial_apply_rotary_pos_emb
    return model


def load_qwen2_oracle(path: str):
    """fp32 eager ``transformers.Qwen2ForCausalLM`` from the checkpoint at ``path``."""
    import torch
    import transformers

    return transformers.Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


# ---------------------------------------------------------------- MiDashengLM: dasheng + torch projector + HF Qwen2


def _expected_audio_tokens(num_samples: int) -> int:
    """Spec midashenglm.md §5 with vLLM's clamp, written independently of the package."""
    num_samples = max(num_samples, 3200)
    return max(1, ((1 + num_samples // 160) // 4) // 5)


def _load_checkpoint_fp32(model_dir: str) -> dict:
    """Every tensor of ``model.safetensors`` or of the shards its ``.index.json`` lists, as fp32 torch tensors
    (safetensors' torch loader, so bf16 checkpoints load too)."""
    import torch
    from safetensors.torch import load_file

    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    tensors = {}
    for name in files:
        tensors.update(load_file(os.path.join(model_dir, name)))
    return {k: v.to(torch.float32) if v.is_floating_point() else v for k, v in tensors.items()}


class MiDashengLMOracle:
    """dasheng encoder (B = 1) + the projector written out in torch + HF ``Qwen2ForCausalLM``, all holding the
    checkpoint's tensors; raises ValueError if any checkpoint tensor would go unused.

    The encoder is fed the package's per-clip log-mel features (that frontend is checked against librosa in
    tests/layers/test_audio_frontend.py); everything after it is dasheng's, torch's and transformers' code.
    """

    def __init__(self, model_dir: str):
        import transformers

        with open(os.path.join(model_dir, "config.json")) as f:
            cfg = json.load(f)
        tensors = _load_checkpoint_fp32(model_dir)
        enc = cfg["audio_encoder_config"]
        pretrained = import_dasheng()
        self.encoder = pretrained.Dasheng(
            embed_dim=enc["embed_dim"], depth=enc["depth"], num_heads=enc["num_heads"],
            patch_size=tuple(enc["patch_size"]), patch_stride=tuple(enc["patch_stride"]),
            target_length=enc["target_length"], qkv_bias=True,
        ).eval()
        state, used = self.encoder.state_dict(), set()
        for name in state:
            if name.startswith("front_end.") or name.endswith("num_batches_tracked"):
                continue
            ckpt = "audio_encoder." + name.replace("init_bn.1.", "init_bn.")
            state[name] = tensors[ckpt]
            used.add(ckpt)
        self.encoder.load_state_dict(state)
        self.projector = {k: tensors[f"audio_projector.net.{k}"] for k in ("0.weight", "0.bias", "2.weight", "2.bias")}
        used |= {f"audio_projector.net.{k}" for k in self.projector}

        text = cfg["text_config"]
        hf_cfg = transformers.Qwen2Config(**{k: text[k] for k in (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings", "hidden_act")},
            rope_theta=text["rope_theta"])
        self.decoder = transformers.Qwen2ForCausalLM(hf_cfg).eval()
        decoder_state = {k[len("decoder."):]: v for k, v in tensors.items() if k.startswith("decoder.")}
        if text["tie_word_embeddings"]:
            decoder_state["lm_head.weight"] = decoder_state["model.embed_tokens.weight"]
        self.decoder.load_state_dict(decoder_state, strict=True)
        used |= {k for k in tensors if k.startswith("decoder.")}
        if used != set(tensors):
            raise ValueError(f"{model_dir}: checkpoint tensors the reference would ignore: {sorted(set(tensors) - used)}")

    def audio_rows(self, wave: np.ndarray):
        """One 16 kHz clip ``[L]`` -> torch ``[N(L), hidden]`` projected rows."""
        import torch

        from fastdeploy_ext.layers.audio.frontend import log_mel_spectrogram

        with torch.no_grad():
            wave = np.pad(wave, (0, max(0, 3200 - wave.shape[0])))
            features = torch.from_numpy(log_mel_spectrogram(wave[None]).numpy())
            hidden = self.encoder.forward_spectrogram(self.encoder.init_bn(features[:, None]),
                                                      x_length=torch.tensor([wave.shape[0]]))
            groups = hidden.shape[1] // 5
            stacked = hidden[:, : groups * 5].reshape(1, groups, -1)
            p = self.projector
            out = torch.nn.functional.linear(
                torch.nn.functional.gelu(torch.nn.functional.linear(stacked, p["0.weight"], p["0.bias"])),
                p["2.weight"], p["2.bias"])
            return out[0, : _expected_audio_tokens(wave.shape[0])]

    def embeddings(self, ids, audio_positions, rows):
        """Text embeddings ``[1, T, hidden]`` of ``ids`` with ``rows`` written at ``audio_positions``."""
        import torch

        with torch.no_grad():
            embeds = self.decoder.model.embed_tokens(torch.tensor([list(ids)]))
            embeds[0, torch.as_tensor(audio_positions, dtype=torch.long)] = rows
        return embeds

    def logprobs(self, ids, audio_positions, rows) -> np.ndarray:
        """Teacher-forced fp32 log-softmax ``[T, V]`` of the merged sequence (row i predicts token i+1)."""
        import torch

        embeds = self.embeddings(ids, audio_positions, rows)
        with torch.no_grad():
            logits = self.decoder(inputs_embeds=embeds, position_ids=torch.arange(len(ids))[None]).logits[0]
            return torch.log_softmax(logits.float(), dim=-1).numpy()


# ---------------------------------------------------------------- per-layer hidden states, both sides


def oracle_logprobs(model, token_ids) -> np.ndarray:
    """Teacher-forced full forward of an HF causal LM; fp32 log-softmax ``[T, V]`` (row i predicts token i+1)."""
    import torch

    with torch.no_grad():
        logits = model(input_ids=torch.tensor([list(token_ids)])).logits[0].float()
        return torch.log_softmax(logits, dim=-1).numpy()


def hf_decoder_states(model, token_ids=None, inputs_embeds=None) -> list[np.ndarray]:
    """``[embed, layer 0 .. L-1, norm]`` of an HF causal LM, each fp32 ``[T, hidden]``, for one teacher-forced
    forward of ``token_ids`` or of ``inputs_embeds`` ``[1, T, hidden]`` (positions 0..T-1)."""
    import torch

    captured = []

    def keep(module, inputs, output):
        # Layers return a tensor in transformers 5 and a tuple (hidden, ...) in 4.x.
        out = output[0] if isinstance(output, tuple) else output
        captured.append(out[0].float().numpy().copy())

    hooks = [layer.register_forward_hook(keep) for layer in model.model.layers]
    try:
        with torch.no_grad():
            if inputs_embeds is None:
                inputs = {"input_ids": torch.tensor([list(token_ids)])}
            else:
                inputs = {"inputs_embeds": inputs_embeds}
            length = next(iter(inputs.values())).shape[1]
            out = model(**inputs, position_ids=torch.arange(length)[None], output_hidden_states=True)
    finally:
        for h in hooks:
            h.remove()
    states = out.hidden_states
    return [states[0][0].float().numpy()] + captured + [states[-1][0].float().numpy()]


def oracle_hidden_states(model, token_ids) -> list[np.ndarray]:
    """Output of every decoder layer of an HF causal LM, each ``[T, hidden]`` (before the final norm)."""
    return hf_decoder_states(model, token_ids)[1:-1]


def decoder_stack(model):
    """The engine model's decoder (``.layers`` and ``.norm``): ``model.model``, or MiDashengLM's ``decoder.model``."""
    return model.decoder.model if hasattr(model, "decoder") else model.model


def engine_decoder_states(llm, prompt: dict) -> tuple[list[np.ndarray], list[int]]:
    """``([embed, layer 0 .. L-1, norm], prompt ids)`` of the engine's model, each fp32 ``[T, hidden]``, from one
    prefill of ``prompt`` (an ``LLM.generate`` prompt dict) run as a single step with ``max_tokens=1``.

    Forward hooks only read tensors, so the model's math is untouched. Raises ``RuntimeError`` if the prompt was
    split over several steps (the LLM needs ``max_num_batched_tokens`` >= the prompt length).
    """
    from fastdeploy_ext import SamplingParams

    stack = decoder_stack(llm.llm_engine.model)
    captured = {"embed": [], "layers": [], "norm": []}

    def layer_output(layer, inputs, output):
        # Qwen2 layers hand (mlp_out, residual) to the next layer's fused add+norm: their sum is the layer output.
        out = output[0] + output[1] if isinstance(output, tuple) else output
        captured["layers"].append(out.numpy().copy())

    hooks = [stack.layers[0].register_forward_pre_hook(lambda m, inputs: captured["embed"].append(inputs[1].numpy().copy())),
             stack.register_forward_post_hook(lambda m, inputs, output: captured["norm"].append(output.numpy().copy()))]
    hooks += [layer.register_forward_post_hook(layer_output) for layer in stack.layers]
    model = llm.llm_engine.model
    # Every prompt row through every layer: a model that selects output rows would run its last layer
    # for the sampled row only.
    model.selects_output_rows = False
    try:
        out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)[0]
    finally:
        del model.selects_output_rows
        for h in hooks:
            h.remove()
    if len(captured["norm"]) != 1:
        raise RuntimeError(f"the prompt ran in {len(captured['norm'])} steps, not one: raise max_num_batched_tokens")
    return captured["embed"] + captured["layers"] + captured["norm"], list(out.prompt_token_ids)


def engine_hidden_states(llm, token_ids) -> list[np.ndarray]:
    """Output of every decoder layer of the engine's model for one prefill of ``token_ids``."""
    return engine_decoder_states(llm, {"prompt_token_ids": list(token_ids)})[0][1:-1]


# ---------------------------------------------------------------- statistics, divergence, report, plot


def layer_statistics(ours: list[np.ndarray], ref: list[np.ndarray], layer_types: list[str],
                     names: list | None = None) -> list[dict]:
    """One row per compared tensor: ``layer`` (``names[i]``, default ``i``), ``type``, ``mean`` and ``std`` of ours,
    ``mean_diff`` and ``max_diff`` of ``|ours - ref|``, and ``rel_err = ||ours - ref|| / ||ref||`` (Frobenius,
    float64)."""
    if len(ours) != len(ref):
        raise ValueError(f"{len(ours)} tensors on our side, {len(ref)} on the reference's")
    rows = []
    for i, (a, b) in enumerate(zip(ours, ref)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if a.shape != b.shape:
            raise ValueError(f"row {i}: shape {a.shape} on our side, {b.shape} on the reference's")
        diff = np.abs(a - b)
        ref_norm = np.linalg.norm(b)
        rows.append({"layer": i if names is None else names[i], "type": layer_types[i], "mean": float(a.mean()),
                     "std": float(a.std()), "mean_diff": float(diff.mean()), "max_diff": float(diff.max()),
                     "rel_err": float(np.linalg.norm(a - b) / ref_norm) if ref_norm > 0 else float(diff.max())})
    return rows


def first_divergence(rows: list[dict], threshold: float = DEFAULT_THRESHOLD) -> dict | None:
    """The first row (in forward order) whose relative error exceeds ``threshold``, or None."""
    return next((r for r in rows if r["rel_err"] > threshold), None)


def format_statistics(rows: list[dict]) -> str:
    """Markdown table of :func:`layer_statistics` rows."""
    lines = ["| layer | type | mean | std | mean \\|diff\\| | max \\|diff\\| | rel err |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['layer']} | {r['type']} | {r['mean']:.4f} | {r['std']:.4f} | {r.get('mean_diff', 0.0):.2e} | "
                     f"{r['max_diff']:.2e} | {r['rel_err']:.2e} |")
    return "\n".join(lines)


def plot_statistics(rows: list[dict], threshold: float, path: str, title: str) -> None:
    """Relative error per row on a log axis, the threshold as a dashed line, the first diverging row in red."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # An exact match has rel err 0, which a log axis cannot show: draw it at the floor and say so in the label.
    floor = 1e-12
    xs = np.arange(len(rows))
    ys = [max(r["rel_err"], floor) for r in rows]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.35 * len(rows) + 2.0), 4.0))
    ax.semilogy(xs, ys, "o-", color="tab:blue", label="rel err (0 drawn at 1e-12)")
    ax.axhline(threshold, color="gray", linestyle="--", label=f"threshold {threshold:g}")
    bad = first_divergence(rows, threshold)
    if bad is not None:
        k = rows.index(bad)
        ax.axvline(k, color="tab:red", alpha=0.4)
        ax.semilogy([k], [ys[k]], "o", color="tab:red", markersize=10, label=f"first diverging: {bad['layer']}")
    ax.set_xticks(xs)
    ax.set_xticklabels([str(r["layer"]) for r in rows], rotation=90 if len(rows) > 24 else 0)
    ax.set_xlabel("layer")
    ax.set_ylabel("||ours - ref|| / ||ref||")
    ax.set_title(title)
    ax.legend(loc="best", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------- the run


@dataclass
class AlignmentResult:
    """Rows of :func:`layer_statistics` (``embed``, ``0 .. L-1``, ``norm``) for one prompt of ``num_tokens`` tokens."""

    arch: str
    reference: str
    num_tokens: int
    rows: list
    threshold: float

    @property
    def diverging(self) -> dict | None:
        return first_divergence(self.rows, self.threshold)

    def report(self) -> str:
        worst = max(self.rows, key=lambda r: r["rel_err"])
        bad = self.diverging
        if bad is None:
            verdict = (f"no diverging layer: every rel err <= {self.threshold:g} "
                       f"(worst {worst['rel_err']:.2e} at {worst['layer']})")
        else:
            verdict = (f"first diverging layer: {bad['layer']} ({bad['type']}, rel err {bad['rel_err']:.2e} > "
                       f"{self.threshold:g})")
        return (f"{self.arch}: {self.num_tokens} prompt tokens, ours (Paddle, fp32) vs {self.reference}\n\n"
                f"{format_statistics(self.rows)}\n\n{verdict}")


def _read_config(model_dir: str) -> tuple[str, dict]:
    """``(architectures[0], raw config.json)``; ValueError if it is missing or has no reference here."""
    path = os.path.join(model_dir, "config.json")
    try:
        with open(path) as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{path} does not exist") from None
    archs = raw.get("architectures") or []
    if not archs or archs[0] not in SUPPORTED_ARCHS:
        raise ValueError(f"{path}: architectures {archs} has no alignment reference; supported: {', '.join(SUPPORTED_ARCHS)}")
    return archs[0], raw


def run_alignment(model_dir: str, prompt: str, audio: list | None = None, reference_dir: str | None = None,
                  threshold: float = DEFAULT_THRESHOLD, max_model_len: int | None = None) -> AlignmentResult:
    """Teacher-force ``prompt`` (and the ``audio`` files for MiDashengLM) through the engine loaded from
    ``model_dir`` and through the reference loaded from ``reference_dir`` (default: the same directory).

    For MiDashengLM a prompt without ``<|AUDIO|>`` gets one ``<|audio_bos|><|AUDIO|><|audio_eos|>`` per clip in
    front. ``max_model_len`` bounds the prompt (default: the model's ``max_position_embeddings``, at most 4096).
    Raises :class:`MissingExtraError` before loading anything when a dependency is missing, ValueError for an
    unsupported architecture or audio given to a text model.
    """
    arch, raw = _read_config(model_dir)
    if reference_dir is not None and _read_config(reference_dir)[0] != arch:
        raise ValueError(f"--model is {arch} but --reference is {_read_config(reference_dir)[0]}")
    if max_model_len is None:
        limit = raw.get("max_position_embeddings") or raw.get("text_config", {}).get("max_position_embeddings")
        max_model_len = min(4096, limit or 4096)
    audio = list(audio or [])
    is_audio_model = arch == "MiDashengLMModel"
    if audio and not is_audio_model:
        raise ValueError(f"{arch} takes no audio; --audio is for MiDashengLMModel")
    require_align_extra(dasheng=is_audio_model)

    from fastdeploy_ext import LLM
    from fastdeploy_ext.layers.audio.io import load_audio, pad_to_min_samples
    from fastdeploy_ext.models.midashenglm.model import AUDIO_BOS, AUDIO_EOS, AUDIO_TOKEN

    ref_dir = reference_dir or model_dir
    # One sequence, one step: the whole prompt must fit max_num_batched_tokens.
    llm = LLM(model=model_dir, max_model_len=max_model_len, max_num_seqs=1, max_num_batched_tokens=max_model_len)
    model = llm.llm_engine.model
    request = {"prompt": prompt}
    if is_audio_model:
        waves = [pad_to_min_samples(load_audio(path)) for path in audio]
        if waves and AUDIO_TOKEN not in prompt:
            request["prompt"] = f"{AUDIO_BOS}{AUDIO_TOKEN}{AUDIO_EOS}" * len(waves) + prompt
        if waves:
            request["multimodal_data"] = {"audio": waves}
    ours, ids = engine_decoder_states(llm, request)
    stack = decoder_stack(model)
    kinds = [("linear" if layer.is_linear else "full") if hasattr(layer, "is_linear") else "decoder"
             for layer in stack.layers]
    audio_id = llm.tokenizer.token_to_id(AUDIO_TOKEN) if is_audio_model else None
    # Only the captured numpy arrays are needed from here on: release our model so that the peak is one model.
    llm.shutdown()
    del llm, model, stack

    if is_audio_model:
        import torch

        oracle = MiDashengLMOracle(ref_dir)
        positions = [i for i, t in enumerate(ids) if t == audio_id]
        rows = (torch.cat([oracle.audio_rows(w) for w in waves]) if waves
                else torch.zeros([0, oracle.decoder.config.hidden_size]))
        ref = hf_decoder_states(oracle.decoder, inputs_embeds=oracle.embeddings(ids, positions, rows))
        reference = "dasheng encoder + torch projector + transformers Qwen2ForCausalLM"
    elif arch in MINIMAX_ARCHS:
        ref = hf_decoder_states(load_minimax_oracle(ref_dir), ids)
        reference = "transformers MiniMaxForCausalLM (RoPE patched to partial)"
    else:
        ref = hf_decoder_states(load_qwen2_oracle(ref_dir), ids)
        reference = "transformers Qwen2ForCausalLM"

    names = ["embed"] + list(range(len(kinds))) + ["norm"]
    rows = layer_statistics(ours, ref, ["embed"] + kinds + ["norm"], names)
    return AlignmentResult(arch, reference, len(ids), rows, threshold)
