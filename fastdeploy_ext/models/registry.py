"""Model registry: one :class:`ModelSpec` per ``config.json`` ``architectures[0]`` (FastDeploy's ``name()`` rule).

Each model package under ``models/`` declares its specs in its ``spec`` module (``SPECS``); shared code (the
engine, the loader's shape checks, the planner, the tool and reasoning parsers, the chat adapter, the tiny
writers, ``fastdeploy-ext align``) reads them from here and names no architecture. Specs hold ``"module:attr"``
references, imported on first use, so that reading the registry imports no model, no Paddle and no torch.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

from fastdeploy_ext.config.base import ConfigError

# The model packages under fastdeploy_ext/models/, each with a ``spec`` module; adding a model adds its name here.
MODEL_PACKAGES = ("qwen2", "minimax_m1", "midashenglm")


@dataclass(frozen=True)
class ModelSpec:
    """What shared code knows about one architecture.

    - ``model``: the ``ModelForCausalLM`` subclass (``name()`` equals ``architecture``; its ``config_class``
      parses config.json);
    - ``checkpoint``: ``(config.json dict) -> model_loader.shapes.ModelShape``, the checkpoint tensor table the
      model's ``load_weights`` routes by, which the engine's shape checks and the planner read too;
    - ``tiny``: ``(out_dir, seed=0, **overrides) -> config dict``, a tiny random checkpoint (None: none);
    - ``tool_parser`` / ``reasoning_parser``: the parser names used unless the deployment names others
      (None: no tool calls without ``--tool-call-parser``; no reasoning split);
    - ``chat_adapter``: the message shape the family's chat template reads (``engine.chat_adapter.ADAPTERS``);
    - ``align``: an ``entrypoints.align.AlignHooks`` (None: ``fastdeploy-ext align`` has no reference for it);
    - ``demo``: the architecture ``fastdeploy-ext demo`` writes and runs (one spec sets it).
    """

    architecture: str
    model: str
    checkpoint: str
    tiny: str | None = None
    tool_parser: str | None = None
    reasoning_parser: str | None = None
    chat_adapter: str = "hf"
    align: str | None = None
    demo: bool = False

    def resolve(self, field: str):
        """The object a ``"module:attr"`` field names (None when the field is None)."""
        ref = getattr(self, field)
        if ref is None:
            return None
        module, _, attr = ref.partition(":")
        return getattr(importlib.import_module(module), attr)


@dataclass(frozen=True)
class AlignHooks:
    """How ``fastdeploy-ext align`` compares one architecture with a reference we did not write.

    - ``reference``: the reference, in words (the report's header);
    - ``reference_states``: ``(reference_dir, prompt ids, request, tokenizer) -> [embed, layer 0 .. L-1, norm]``,
      each fp32 ``[T, hidden]``, from one teacher-forced forward of the prompt the engine ran;
    - ``build_request``: ``(prompt, audio paths) -> LLM.generate prompt dict`` for a model that takes audio
      (None: text only, ``--audio`` is refused);
    - ``extras``: optional packages the reference needs beyond torch and transformers.
    """

    reference: str
    reference_states: Callable
    build_request: Callable | None = None
    extras: tuple = ()


_SPECS: dict[str, ModelSpec] = {}
_loaded = False


def register(spec: ModelSpec) -> None:
    """Add (or replace) the spec of ``spec.architecture``."""
    _SPECS[spec.architecture] = spec


def all_specs() -> dict[str, ModelSpec]:
    """``{architecture: spec}`` of every model package (imported once) plus any registered since."""
    global _loaded
    if not _loaded:
        for package in MODEL_PACKAGES:
            for spec in importlib.import_module(f"fastdeploy_ext.models.{package}.spec").SPECS:
                _SPECS.setdefault(spec.architecture, spec)
        _loaded = True
    return _SPECS


def known_architectures() -> list[str]:
    return sorted(all_specs())


def find_spec(architecture: str) -> ModelSpec | None:
    return all_specs().get(architecture)


def get_spec(architecture: str) -> ModelSpec:
    spec = find_spec(architecture)
    if spec is None:
        raise ConfigError(
            f"unknown architecture {architecture!r} in config.json 'architectures'; known: {', '.join(known_architectures())}"
        )
    return spec


def get_model_class(architecture: str):
    spec = get_spec(architecture)
    cls = spec.resolve("model")
    if cls.name() != architecture:
        raise ConfigError(f"{spec.model}.name() is {cls.name()!r}, registered as {architecture!r}")
    return cls


def architecture_of(hf_config: dict) -> str:
    archs = hf_config.get("architectures")
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise ConfigError(f"config.json: 'architectures' must be a non-empty list of strings; known: {', '.join(known_architectures())}")
    return archs[0]


def checkpoint_shape(raw: dict):
    """The ``ModelShape`` (checkpoint tensor table and cache geometry) a config.json dict implies, or None for an
    architecture no model declares."""
    archs = raw.get("architectures")
    spec = find_spec(archs[0]) if isinstance(archs, list) and archs and isinstance(archs[0], str) else None
    return None if spec is None else spec.resolve("checkpoint")(raw)
