"""MiDashengLM's registry entry: its Qwen2 decoder writes Qwen2's tool-call syntax."""

from fastdeploy_ext.models.registry import ModelSpec

SPECS = [
    ModelSpec(
        architecture="MiDashengLMModel",
        model="fastdeploy_ext.models.midashenglm.model:MiDashengLMModel",
        checkpoint="fastdeploy_ext.models.midashenglm.weights:checkpoint_shape",
        tiny="fastdeploy_ext.models.midashenglm.tiny:write_tiny_midashenglm",
        tool_parser="qwen2",
        align="fastdeploy_ext.models.midashenglm.align:HOOKS",
    ),
]
