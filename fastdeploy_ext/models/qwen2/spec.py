"""Qwen2's registry entry."""

from fastdeploy_ext.models.registry import ModelSpec

SPECS = [
    ModelSpec(
        architecture="Qwen2ForCausalLM",
        model="fastdeploy_ext.models.qwen2.model:Qwen2ForCausalLM",
        checkpoint="fastdeploy_ext.models.qwen2.weights:checkpoint_shape",
        tiny="fastdeploy_ext.models.qwen2.tiny:write_tiny_qwen2",
        tool_parser="qwen2",
        align="fastdeploy_ext.models.qwen2.align:HOOKS",
        demo=True,
    ),
]
