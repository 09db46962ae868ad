"""fastdeploy_ext: MiniMax-M1 and MiDashengLM on a FastDeploy-style engine for PaddlePaddle.

The top-level names are imported lazily so that kernel modules (``fastdeploy_ext.ops``) import on
machines that have torch + Triton but no Paddle.
"""

__version__ = "0.1.0"

_LAZY = {
    "LLM": "fastdeploy_ext.engine.llm",
    "SamplingParams": "fastdeploy_ext.engine.sampling_params",
    "RequestOutput": "fastdeploy_ext.engine.request",
    "CompletionOutput": "fastdeploy_ext.engine.request",
    "ToolCall": "fastdeploy_ext.engine.request",
    "GuidedDecodingParams": "fastdeploy_ext.engine.guided_decoding",
}

__all__ = list(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'fastdeploy_ext' has no attribute {name!r}")
