"""MiDashengLM's alignment reference: the PyPI ``dasheng`` encoder + the projector written out in torch +
transformers ``Qwen2ForCausalLM`` (docs/models/midashenglm.md).

dasheng pulls torchaudio; ``fastdeploy-ext align`` checks that it imports (``require_align_extra``) before this
module builds anything.
"""

from __future__ import annotations

import json
import os

import numpy as np

from fastdeploy_ext.models.hf_reference import hf_decoder_states
from fastdeploy_ext.models.midashenglm.model import AUDIO_BOS, AUDIO_EOS, AUDIO_TOKEN
from fastdeploy_ext.models.registry import AlignHooks


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
        from dasheng.pretrained import pretrained

        with open(os.path.join(model_dir, "config.json")) as f:
            cfg = json.load(f)
        tensors = _load_checkpoint_fp32(model_dir)
        enc = cfg["audio_encoder_config"]
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


def _build_request(prompt: str, audio: list) -> dict:
    """A prompt without ``<|AUDIO|>`` gets one ``<|audio_bos|><|AUDIO|><|audio_eos|>`` per clip in front."""
    from fastdeploy_ext.layers.audio.io import load_audio, pad_to_min_samples

    waves = [pad_to_min_samples(load_audio(path)) for path in audio]
    request = {"prompt": prompt}
    if waves and AUDIO_TOKEN not in prompt:
        request["prompt"] = f"{AUDIO_BOS}{AUDIO_TOKEN}{AUDIO_EOS}" * len(waves) + prompt
    if waves:
        request["multimodal_data"] = {"audio": waves}
    return request


def _reference_states(reference_dir: str, ids: list, request: dict, tokenizer) -> list:
    import torch

    oracle = MiDashengLMOracle(reference_dir)
    audio_id = tokenizer.token_to_id(AUDIO_TOKEN)
    positions = [i for i, t in enumerate(ids) if t == audio_id]
    waves = (request.get("multimodal_data") or {}).get("audio") or []
    rows = (torch.cat([oracle.audio_rows(w) for w in waves]) if waves
            else torch.zeros([0, oracle.decoder.config.hidden_size]))
    return hf_decoder_states(oracle.decoder, inputs_embeds=oracle.embeddings(ids, positions, rows))


HOOKS = AlignHooks(reference="dasheng encoder + torch projector + transformers Qwen2ForCausalLM",
                   reference_states=_reference_states, build_request=_build_request, extras=("dasheng",))
