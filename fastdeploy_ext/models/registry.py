"""Model registry keyed by ``config.json``'s ``architectures[0]`` (FastDeploy's ``name()`` rule).

Entries are imported lazily so that importing the registry does not import every model.
"""

from __future__ import annotations

import importlib

from fastdeploy_ext.config.base import ConfigError

_MODELS: dict[str, tuple[str, str]] = {
    "Qwen2ForCausalLM": ("fastdeploy_ext.models.qwen2.model", "Qwen2ForCausalLM"),
    "MiniMaxM1ForCausalLM": ("fastdeploy_ext.models.minimax_m1.model", "MiniMaxM1ForCausalLM"),
    "MiniMaxText01ForCausalLM": ("fastdeploy_ext.models.minimax_m1.model", "MiniMaxText01ForCausalLM"),
    "MiniMaxForCausalLM": ("fastdeploy_ext.models.minimax_m1.model", "MiniMaxForCausalLM"),
    "MiDashengLMModel": ("fastdeploy_ext.models.midashenglm.model", "MiDashengLMModel"),
}


def register_model(architecture: str, module: str, class_name: str) -> None:
    _MODELS[architecture] = (module, class_name)


def known_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architecture: str):
    if architecture not in _MODELS:
        raise ConfigError(
            f"unknown architecture {architecture!r} in config.json 'architectures'; known: {', '.join(known_architectures())}"
        )
    module, name = _MODELS[architecture]
    cls = getattr(importlib.import_module(module), name)
    if cls.name() != architecture:
        raise ConfigError(f"{module}.{name}.name() is {cls.name()!r}, registered as {architecture!r}")
    return cls


def architecture_of(hf_config: dict) -> str:
    archs = hf_config.get("architectures")
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise ConfigError(f"config.json: 'architectures' must be a non-empty list of strings; known: {', '.join(known_architectures())}")
    return archs[0]
