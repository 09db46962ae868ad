"""Typed config for MiDashengLM: Dasheng audio encoder + subsampling projector + Qwen2 decoder.

``config.json`` layout (HF ``MiDashengLMConfig``): top-level ``architectures``, ``subsample_factor``, ``audio_token_id``,
and two nested dicts, ``audio_encoder_config`` (:class:`fastdeploy_ext.config.dasheng.DashengConfig`) and
``text_config`` (a Qwen2.5-Omni text config, parsed by :class:`fastdeploy_ext.models.qwen2.config.Qwen2Config`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from fastdeploy_ext.config.base import ConfigError, get_key
from fastdeploy_ext.config.dasheng import DashengConfig
from fastdeploy_ext.models.qwen2.config import Qwen2Config

ARCHITECTURE = "MiDashengLMModel"
# The first 0804 upload used these names for the same weights under another module tree.
_LEGACY_ARCHITECTURES = ("DashengQwen25OmniModelInstruct",)
# Qwen2.5-Omni's text config class default; Qwen2Config's own default (1e4) would silently build another model.
OMNI_ROPE_THETA = 1e6


@dataclass(frozen=True)
class MiDashengLMConfig:
    """Top-level MiDashengLM config.

    ``text_config`` is the raw decoder dict; ``audio_token_id`` is None when config.json omits it (the processor
    then takes ``<|AUDIO|>`` from the tokenizer; see :meth:`check_audio_token_id`).
    """

    architectures: list
    audio_encoder_config: DashengConfig
    text_config: dict
    subsample_factor: int
    audio_token_id: Optional[int]
    text_hidden_size: int

    @property
    def projector_input_dim(self) -> int:
        """``embed_dim * subsample_factor``: 5 consecutive 40 ms frames concatenated frame-major."""
        return self.audio_encoder_config.embed_dim * self.subsample_factor

    def check_audio_token_id(self, tokenizer_id: int) -> int:
        """The ``<|AUDIO|>`` id to use, given the tokenizer's; both must agree when config.json names one."""
        if self.audio_token_id is not None and self.audio_token_id != tokenizer_id:
            raise ConfigError(
                f"config.json audio_token_id {self.audio_token_id} != tokenizer's <|AUDIO|> id {tokenizer_id}"
            )
        return tokenizer_id

    @classmethod
    def from_hf_config(cls, cfg: dict, where: str = "config.json") -> "MiDashengLMConfig":
        if not isinstance(cfg, dict):
            raise ConfigError(f"{where} must be a JSON object, got {type(cfg).__name__}")
        architectures = get_key(cfg, "architectures", where, types=(list,))
        if ARCHITECTURE not in architectures:
            legacy = [a for a in architectures if a in _LEGACY_ARCHITECTURES]
            hint = " (the first 0804 'miaudiollm' upload; use a current MiDashengLM revision)" if legacy else ""
            raise ConfigError(f"{where}: architectures {architectures} does not contain {ARCHITECTURE!r}{hint}")
        encoder = DashengConfig.from_hf_config(
            get_key(cfg, "audio_encoder_config", where, types=(dict,)), f"{where}: audio_encoder_config"
        )
        text_config = get_key(cfg, "text_config", where, types=(dict,))
        text_hidden_size = get_key(text_config, "hidden_size", f"{where}: text_config", types=(int,), ge=1)
        subsample_factor = get_key(cfg, "subsample_factor", where, default=5, types=(int,))
        if subsample_factor < 1:
            raise ConfigError(f"{where}: key 'subsample_factor' must be >= 1, got {subsample_factor}")
        audio_token_id = get_key(cfg, "audio_token_id", where, default=None, types=(int,))
        vocab_size = text_config.get("vocab_size")
        if audio_token_id is not None and isinstance(vocab_size, int) and not 0 <= audio_token_id < vocab_size:
            raise ConfigError(f"{where}: audio_token_id {audio_token_id} outside text_config.vocab_size {vocab_size}")
        return cls(
            architectures=list(architectures),
            audio_encoder_config=encoder,
            text_config=dict(text_config),
            subsample_factor=subsample_factor,
            audio_token_id=audio_token_id,
            text_hidden_size=text_hidden_size,
        )


@dataclass(frozen=True)
class MiDashengLMModelConfig(MiDashengLMConfig):
    """:class:`MiDashengLMConfig` plus the parsed decoder (``text``) and the fields the engine reads.

    ``tie_word_embeddings_given`` is False when neither ``text_config`` nor the top level sets
    ``tie_word_embeddings``: transformers 4.x then unties and 5.x ties, so the checkpoint decides (a stored
    ``decoder.lm_head.weight`` means untied; without one loading fails).
    """

    text: Qwen2Config
    tie_word_embeddings_given: bool

    @property
    def vocab_size(self) -> int:
        return self.text.vocab_size

    @property
    def max_position_embeddings(self) -> int:
        return self.text.max_position_embeddings

    @property
    def eos_token_id(self) -> list:
        return self.text.eos_token_id

    @classmethod
    def from_hf_config(cls, cfg: dict, where: str = "config.json") -> "MiDashengLMModelConfig":
        base = MiDashengLMConfig.from_hf_config(cfg, where)
        text = dict(base.text_config)
        tie = text.get("tie_word_embeddings", cfg.get("tie_word_embeddings"))
        if tie is not None and not isinstance(tie, bool):
            raise ConfigError(f"{where}: 'tie_word_embeddings' must be a bool, got {tie!r}")
        text["tie_word_embeddings"] = bool(tie)
        if "rope_theta" not in text and "rope_theta" not in (text.get("rope_parameters") or {}):
            text["rope_theta"] = OMNI_ROPE_THETA
        decoder = Qwen2Config.from_hf_config(text, where=f"{where}: text_config")
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(MiDashengLMConfig)}
        return cls(**fields, text=decoder, tie_word_embeddings_given=tie is not None)
