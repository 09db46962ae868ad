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

Each model declares its reference in its own package (``models/<name>/align.py``, the ``align`` hooks of its
registry spec). torch, transformers, dasheng and matplotlib are imported inside functions: the package works without
the ``align`` extra, and :func:`require_align_extra` turns their absence into a clear message.
"""

from __future__ import annotations

import importlib
import json
import os
from dataclasses import dataclass

import numpy as np

from fastdeploy_ext.models.hf_reference import hf_decoder_states
from fastdeploy_ext.models.registry import AlignHooks, find_spec, known_architectures

# Relative error above which a row counts as diverging. fp32 on both sides gives ~1e-6 per op; a tiny model's
# layers measure <= 1e-6 and a real model's deeper stack a few 1e-5, so 1e-4 only trips on a real difference.
DEFAULT_THRESHOLD = 1e-4

INSTALL_HINT = 'pip install -e ".[align]"'

class MissingExtraError(RuntimeError):
    """An optional dependency of the alignment tooling is not importable; the message says what to install."""


def require_align_extra(*, extras: tuple = (), plot: bool = False) -> None:
    """Import torch and transformers (plus a reference's ``extras`` and matplotlib when asked); raise
    :class:`MissingExtraError` naming the install command for the first one that fails."""
    needed = ["torch", "transformers"] + [e for e in extras if e != "dasheng"] + (["matplotlib"] if plot else [])
    for name in needed:
        try:
            importlib.import_module(name)
        except (ImportError, OSError) as e:
            raise MissingExtraError(f"fastdeploy-ext align needs {name}, which cannot be imported ({e}); "
                                    f"install the align extra: {INSTALL_HINT}") from None
    if "dasheng" in extras:
        import_dasheng()


def import_dasheng():
    """``dasheng.pretrained.pretrained`` or :class:`MissingExtraError`.

    dasheng pulls torchaudio, whose C extensions may be built for another torch (docs/models/midashenglm.md: the
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
            "torchaudio/lib (torchaudio then runs in pure Python; docs/models/midashenglm.md)") from None
    return pretrained


# ---------------------------------------------------------------- per-layer hidden states, both sides


def oracle_logprobs(model, token_ids) -> np.ndarray:
    """Teacher-forced full forward of an HF causal LM; fp32 log-softmax ``[T, V]`` (row i predicts token i+1)."""
    import torch

    with torch.no_grad():
        logits = model(input_ids=torch.tensor([list(token_ids)])).logits[0].float()
        return torch.log_softmax(logits, dim=-1).numpy()


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

    def embed_input(m, inputs):
        captured["embed"].append(inputs[0].numpy().copy())

    hooks = [stack.layers[0].register_forward_pre_hook(embed_input),
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


def _supported() -> list[str]:
    return [arch for arch in known_architectures() if find_spec(arch).align is not None]


def _read_config(model_dir: str) -> tuple[str, dict, AlignHooks]:
    """``(architectures[0], raw config.json, its alignment hooks)``; ValueError if it is missing or has no
    reference here."""
    path = os.path.join(model_dir, "config.json")
    try:
        with open(path) as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{path} does not exist") from None
    archs = raw.get("architectures") or []
    spec = find_spec(archs[0]) if archs and isinstance(archs[0], str) else None
    if spec is None or spec.align is None:
        raise ValueError(f"{path}: architectures {archs} has no alignment reference; supported: {', '.join(_supported())}")
    return archs[0], raw, spec.resolve("align")


def run_alignment(model_dir: str, prompt: str, audio: list | None = None, reference_dir: str | None = None,
                  threshold: float = DEFAULT_THRESHOLD, max_model_len: int | None = None) -> AlignmentResult:
    """Teacher-force ``prompt`` (and the ``audio`` files, for a model that takes audio) through the engine loaded
    from ``model_dir`` and through the reference the model declares, loaded from ``reference_dir`` (default: the
    same directory).

    The model's hooks build the request (MiDashengLM: a prompt without ``<|AUDIO|>`` gets one
    ``<|audio_bos|><|AUDIO|><|audio_eos|>`` per clip in front). ``max_model_len`` bounds the prompt (default: the
    model's ``max_position_embeddings``, at most 4096). Raises :class:`MissingExtraError` before loading anything
    when a dependency is missing, ValueError for an unsupported architecture or audio given to a text model.
    """
    arch, raw, hooks = _read_config(model_dir)
    if reference_dir is not None and _read_config(reference_dir)[0] != arch:
        raise ValueError(f"--model is {arch} but --reference is {_read_config(reference_dir)[0]}")
    if max_model_len is None:
        limit = raw.get("max_position_embeddings") or raw.get("text_config", {}).get("max_position_embeddings")
        max_model_len = min(4096, limit or 4096)
    audio = list(audio or [])
    if audio and hooks.build_request is None:
        audio_archs = [a for a in _supported() if find_spec(a).resolve("align").build_request is not None]
        raise ValueError(f"{arch} takes no audio; --audio is for {', '.join(audio_archs)}")
    require_align_extra(extras=hooks.extras)

    from fastdeploy_ext import LLM

    # One sequence, one step: the whole prompt must fit max_num_batched_tokens.
    llm = LLM(model=model_dir, max_model_len=max_model_len, max_num_seqs=1, max_num_batched_tokens=max_model_len)
    model = llm.llm_engine.model
    request = {"prompt": prompt} if hooks.build_request is None else hooks.build_request(prompt, audio)
    ours, ids = engine_decoder_states(llm, request)
    stack = decoder_stack(model)
    kinds = [("linear" if layer.is_linear else "full") if hasattr(layer, "is_linear") else "decoder"
             for layer in stack.layers]
    tokenizer = llm.tokenizer
    # Only the captured numpy arrays are needed from here on: release our model so that the peak is one model.
    llm.shutdown()
    del llm, model, stack

    ref = hooks.reference_states(reference_dir or model_dir, ids, request, tokenizer)
    names = ["embed"] + list(range(len(kinds))) + ["norm"]
    rows = layer_statistics(ours, ref, ["embed"] + kinds + ["norm"], names)
    return AlignmentResult(arch, hooks.reference, len(ids), rows, threshold)
