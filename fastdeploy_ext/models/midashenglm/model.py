"""MiDashengLM: Dasheng audio encoder -> subsampling projector -> the engine's Qwen2 decoder.

A prompt carries one ``<|AUDIO|>`` placeholder per clip; :meth:`MiDashengLMModel.multimodal_processor` expands each into
``N(L)`` audio tokens (wrapped in ``<|audio_bos|>``/``<|audio_eos|>``) and records their prompt positions. During
prefill the model overwrites the text embeddings at those positions, in order, with the projector's rows. The encoder
runs at most once per clip per request: its rows are cached on the request's :class:`AudioInputs`, so later prefill
chunks and a recompute after preemption reuse them, and they are released with the request. A clip whose whole span
was resumed from the prefix cache is never encoded. Decode steps never touch audio.

Checkpoint names (docs/models/midashenglm.md): ``audio_encoder.*`` (``blocks.{i}``), ``audio_projector.net.{0,2}``,
``decoder.model.*``, ``decoder.lm_head``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import paddle
from paddle import nn

from fastdeploy_ext.layers.audio.dasheng import AudioProjectorSubsample, DashengAudioEncoder
from fastdeploy_ext.layers.audio.frontend import log_mel_spectrogram
from fastdeploy_ext.layers.audio.io import audio_token_count, load_audio, pad_to_min_samples
from fastdeploy_ext.layers.embeddings import ParallelLMHead, tied_lm_logits
from fastdeploy_ext.layers.utils import WeightLoadError
from fastdeploy_ext.models.base import KVCacheSpec, ModelForCausalLM, load_weights_by_table
from fastdeploy_ext.models.midashenglm.config import MiDashengLMModelConfig
from fastdeploy_ext.models.midashenglm.weights import IGNORED_TENSORS, midashenglm_tensors
from fastdeploy_ext.models.qwen2.config import Qwen2Config
from fastdeploy_ext.models.qwen2.model import Qwen2Model, _check_tied_head

AUDIO_TOKEN = "<|AUDIO|>"
AUDIO_BOS = "<|audio_bos|>"
AUDIO_EOS = "<|audio_eos|>"

@dataclass
class AudioInputs:
    """A request's audio (``Request.multimodal_inputs``), shared by its ``n`` sibling sequences.

    - ``waveforms``: per clip, float32 ``[L_k]`` mono 16 kHz, ``L_k >= 3200`` (shorter clips zero-padded)
    - ``num_tokens``: per clip, ``N(L_k)`` audio tokens
    - ``positions``: int64 ``[sum N]`` prompt indices of the audio tokens, clip after clip (ascending)
    - ``clip_rows``: per clip its ``[N_k, hidden]`` projected rows, None until a step needs them
    """

    waveforms: list
    num_tokens: list
    positions: np.ndarray
    clip_rows: list | None = None

    @cached_property
    def offsets(self) -> np.ndarray:
        """Clip ``k``'s audio tokens are ``positions[offsets[k]:offsets[k + 1]]`` (consecutive prompt positions)."""
        return np.concatenate([[0], np.cumsum(self.num_tokens)]).astype(np.int64)

    def span(self, k: int) -> tuple:
        """``[first, end)`` prompt positions of clip ``k``."""
        return int(self.positions[self.offsets[k]]), int(self.positions[self.offsets[k + 1] - 1]) + 1

    @cached_property
    def digests(self) -> list:
        """SHA-256 of each clip's 16 kHz float32 samples (what the encoder reads), for prefix-cache keys."""
        return [hashlib.sha256(b"16kHz-float32-le" + np.ascontiguousarray(w, "<f4").tobytes()).digest()
                for w in self.waveforms]


class MiDashengLMDecoder(nn.Layer):
    """``decoder.model`` (the engine's :class:`Qwen2Model`) and ``decoder.lm_head`` (absent when tied)."""

    def __init__(self, fd_config, cfg: Qwen2Config, prefix: str = "decoder"):
        super().__init__()
        self.fd_config = fd_config
        self.model = Qwen2Model(fd_config, cfg, prefix=f"{prefix}.model")
        self.lm_head = (
            None if cfg.tie_word_embeddings else ParallelLMHead(fd_config, cfg.hidden_size, cfg.vocab_size, f"{prefix}.lm_head")
        )

    def compute_logits(self, hidden: paddle.Tensor) -> paddle.Tensor:
        """``[N, hidden]`` -> fp32 ``[N, vocab]``."""
        if self.lm_head is None:
            return tied_lm_logits(self.model.embed_tokens, hidden, self.fd_config)
        return self.lm_head(hidden)


class MiDashengLMModel(ModelForCausalLM):
    config_class = MiDashengLMModelConfig
    # The decoder's fused parameters and the checkpoint projections they hold, in shard order (FastDeploy spelling);
    # quantization matches per-shard names with it.
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "up_gate_proj": ["gate_proj", "up_proj"]}
    # Kept in full precision under any quantization: only the decoder's linears are quantized.
    quant_skip_modules = ("audio_encoder", "audio_projector")

    def __init__(self, fd_config):
        super().__init__(fd_config)
        cfg: MiDashengLMModelConfig = fd_config.model_config
        self.cfg = cfg
        self.audio_encoder = DashengAudioEncoder(fd_config, "audio_encoder", cfg.audio_encoder_config)
        self.audio_projector = AudioProjectorSubsample(
            fd_config, "audio_projector", cfg.audio_encoder_config.embed_dim, cfg.text.hidden_size, cfg.subsample_factor
        )
        self.decoder = MiDashengLMDecoder(fd_config, cfg.text, prefix="decoder")

    @classmethod
    def name(cls) -> str:
        return "MiDashengLMModel"

    def kv_cache_spec(self):
        attn = self.decoder.model.layers[0].self_attn
        return [KVCacheSpec(attn.num_kv_heads, attn.head_dim)] * self.cfg.text.num_hidden_layers

    def compute_logits(self, hidden):
        return self.decoder.compute_logits(hidden)

    def prefix_cache_spans(self, multimodal_inputs) -> list:
        # Every clip expands to identical <|AUDIO|> ids: the keys of blocks holding audio need the clip's content.
        if not isinstance(multimodal_inputs, AudioInputs):
            return []
        audio = multimodal_inputs
        return [(*audio.span(k), audio.digests[k]) for k in range(len(audio.waveforms))]

    def forward(self, ids_remove_padding, forward_meta):
        """``[T]`` ids -> ``[T, hidden]``. Audio rows replace the embeddings of this step's audio tokens;
        ``forward_meta.extra["requests"]`` gives each sequence's request (None or absent: text only)."""
        embeds = self.decoder.model.embed_tokens(ids_remove_padding)
        token_index, rows = self._step_audio_rows(forward_meta)
        if token_index is not None:
            embeds = paddle.scatter(embeds, paddle.to_tensor(token_index), rows.astype(embeds.dtype), overwrite=True)
        return self.decoder.model(ids_remove_padding, forward_meta, inputs_embeds=embeds)

    def _step_audio_rows(self, forward_meta):
        """Step token indices ``[A]`` that hold audio tokens and their rows ``[A, hidden]`` (or ``(None, None)``).

        Sequence ``b`` covers prompt positions ``[start, start + n)`` with ``start = seq_lens_decoder[b]``; its audio
        positions in that window may start or end mid-clip (chunked prefill). Clips not yet encoded are encoded
        here, all in one batch, except those that end before ``start``: their tokens were computed by an earlier
        step (which encoded them) or resumed from the prefix cache (so they are never needed).
        """
        requests = forward_meta.extra.get("requests") or []
        windows = []
        for b, request in enumerate(requests):
            audio = getattr(request, "multimodal_inputs", None)
            if not isinstance(audio, AudioInputs):
                continue
            start = int(forward_meta.seq_lens_decoder[b])
            lo, hi = np.searchsorted(audio.positions, [start, start + int(forward_meta.seq_lens_this_time[b])])
            if hi > lo:
                windows.append((b, start, audio, int(lo), int(hi)))
        if not windows:
            return None, None

        pending = {}
        for _, start, audio, _, _ in windows:
            if audio.clip_rows is None:
                audio.clip_rows = [None] * len(audio.waveforms)
            for k, rows in enumerate(audio.clip_rows):
                if rows is None and audio.span(k)[1] > start:
                    pending[(id(audio), k)] = (audio, k)
        if pending:
            self._encode(list(pending.values()))
        token_index, rows = [], []
        for b, start, audio, lo, hi in windows:
            token_index.append(forward_meta.cu_seqlens_q[b] + audio.positions[lo:hi] - start)
            for k, clip in enumerate(audio.clip_rows):
                first, end = audio.offsets[k], audio.offsets[k + 1]
                if max(lo, first) < min(hi, end):
                    rows.append(clip[max(lo, first) - first:min(hi, end) - first])
        return np.concatenate(token_index).astype(np.int64), paddle.concat(rows, axis=0)

    def _encode(self, clips: list) -> None:
        """Run frontend, encoder and projector over the clips ``(AudioInputs, k)`` as one padded batch and store
        each clip's first ``N(L_k)`` rows. Each clip's frontend sees only its own samples and the key mask hides
        the padding, so a clip's rows do not depend on its batch neighbours."""
        waves = [audio.waveforms[k] for audio, k in clips]
        lengths = np.array([w.shape[0] for w in waves], np.int64)
        padded = np.zeros([len(waves), int(lengths.max())], np.float32)
        for i, w in enumerate(waves):
            padded[i, : w.shape[0]] = w
        hidden, keep = self.audio_encoder(log_mel_spectrogram(padded, lengths, self.audio_encoder.dtype), lengths)
        projected, _ = self.audio_projector(hidden, keep)
        for i, (audio, k) in enumerate(clips):
            n = audio.num_tokens[k]
            if projected.shape[1] < n:
                raise ValueError(f"projector gave {projected.shape[1]} rows for a clip that needs {n} audio tokens")
            audio.clip_rows[k] = projected[i, :n]

    @staticmethod
    def place_audio(text: str, num_clips: int) -> str:
        """``text`` with one ``<|audio_bos|><|AUDIO|><|audio_eos|>`` per clip in front, unless it places them itself
        (a plain prompt given with audio files)."""
        return text if AUDIO_TOKEN in text else f"{AUDIO_BOS}{AUDIO_TOKEN}{AUDIO_EOS}" * num_clips + text

    def multimodal_processor(self, tokenizer, text, ids, multimodal_data):
        """Load the audio and expand the placeholders: ``(text, ids, mm) -> (text, expanded ids, AudioInputs | None)``.

        ``multimodal_data``: None or ``{"audio": [source, ...]}`` (a single source is accepted too); a source is a
        waveform at 16 kHz, ``(waveform, sample_rate)``, a path or encoded bytes (see ``load_audio``). The prompt must
        hold exactly one ``<|AUDIO|>`` per clip; each becomes ``N(L)`` copies inside ``<|audio_bos|>...<|audio_eos|>``
        (added unless already there). Raises ValueError/TypeError naming the clip and the problem.
        """
        audio_id, bos_id, eos_id = self._special_ids(tokenizer)
        clips = self._load_clips(multimodal_data)
        places = [i for i, t in enumerate(ids) if t == audio_id]
        if len(places) != len(clips):
            raise ValueError(
                f"the prompt has {len(places)} {AUDIO_TOKEN} placeholder(s) but {len(clips)} audio clip(s) were given; "
                f"put exactly one {AUDIO_TOKEN} per clip, in order"
            )
        if not clips:
            return text, list(ids), None
        out, positions, num_tokens, prev = [], [], [], 0
        for p, wave in zip(places, clips):
            n = audio_token_count(wave.shape[0], self.cfg.subsample_factor)
            wrapped = 0 < p < len(ids) - 1 and ids[p - 1] == bos_id and ids[p + 1] == eos_id
            out.extend(ids[prev:p] if wrapped else [*ids[prev:p], bos_id])
            positions.extend(range(len(out), len(out) + n))
            out.extend([audio_id] * n)
            if not wrapped:
                out.append(eos_id)
            num_tokens.append(n)
            prev = p + 1
        out.extend(ids[prev:])
        return text, out, AudioInputs(clips, num_tokens, np.asarray(positions, np.int64))

    def _special_ids(self, tokenizer) -> tuple:
        found = {t: tokenizer.token_to_id(t) for t in (AUDIO_TOKEN, AUDIO_BOS, AUDIO_EOS)}
        missing = [t for t, i in found.items() if i is None]
        if missing:
            raise ValueError(f"the tokenizer has no {', '.join(missing)} token(s); MiDashengLM needs all three")
        return self.cfg.check_audio_token_id(found[AUDIO_TOKEN]), found[AUDIO_BOS], found[AUDIO_EOS]

    @staticmethod
    def _load_clips(multimodal_data) -> list:
        """16 kHz float32 mono waveforms, each at least 3200 samples, from ``multimodal_data["audio"]``."""
        if multimodal_data is None:
            return []
        if not isinstance(multimodal_data, dict):
            raise TypeError(f"multimodal_data must be a dict like {{'audio': [...]}}, got {type(multimodal_data).__name__}")
        unknown = sorted(set(multimodal_data) - {"audio"})
        if unknown:
            raise ValueError(f"multimodal_data has unsupported key(s) {unknown}; MiDashengLM takes 'audio' only")
        sources = multimodal_data.get("audio")
        if sources is None:
            return []
        if not isinstance(sources, list):
            sources = [sources]
        clips = []
        for k, source in enumerate(sources):
            try:
                clips.append(pad_to_min_samples(load_audio(source)))
            except (ValueError, TypeError, FileNotFoundError) as e:
                raise (TypeError if isinstance(e, TypeError) else ValueError)(f"audio[{k}]: {e}") from None
        return clips

    def load_weights(self, weights) -> set:
        """Load every checkpoint tensor into its parameter through the checkpoint table (strict both ways; see
        ``weights.IGNORED_TENSORS``); returns the loaded checkpoint names."""
        tied = self.cfg.text.tie_word_embeddings
        weights = _check_tied_head(self._check_head_given(weights), tied, "decoder.lm_head.weight",
                                   "decoder.model.embed_tokens.weight")
        table = midashenglm_tensors(self.cfg, None if tied else "decoder.lm_head.weight")
        return load_weights_by_table(self, weights, table, ignore=IGNORED_TENSORS)

    def _check_head_given(self, weights):
        saw_head = False
        for name, tensor in weights:
            saw_head |= name == "decoder.lm_head.weight"
            yield name, tensor
        if not self.cfg.tie_word_embeddings_given and not saw_head:
            raise WeightLoadError(
                "config.json sets tie_word_embeddings nowhere (text_config or top level) and the checkpoint has no "
                "'decoder.lm_head.weight': transformers 4.x would leave lm_head untied, 5.x would tie it; "
                "set tie_word_embeddings explicitly"
            )
