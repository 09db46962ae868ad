"""MiniMax's registry entries: one per ``architectures[0]`` spelling, each with its own class (``name()`` must
equal it). Every spelling writes M1's tool-call syntax and reads messages in M1's template shape; M1 checkpoints
always think, so only they split reasoning off by default."""

from fastdeploy_ext.models.registry import ModelSpec

_COMMON = dict(
    checkpoint="fastdeploy_ext.models.minimax_m1.weights:checkpoint_shape",
    tool_parser="minimax_m1",
    chat_adapter="minimax_m1",
    align="fastdeploy_ext.models.minimax_m1.align:HOOKS",
)

SPECS = [
    ModelSpec(architecture="MiniMaxM1ForCausalLM", model="fastdeploy_ext.models.minimax_m1.model:MiniMaxM1ForCausalLM",
              tiny="fastdeploy_ext.models.minimax_m1.tiny:write_tiny_minimax_m1", reasoning_parser="minimax_m1",
              **_COMMON),
    ModelSpec(architecture="MiniMaxText01ForCausalLM",
              model="fastdeploy_ext.models.minimax_m1.model:MiniMaxText01ForCausalLM", **_COMMON),
    # HF-native checkpoints (model_type "minimax").
    ModelSpec(architecture="MiniMaxForCausalLM", model="fastdeploy_ext.models.minimax_m1.model:MiniMaxForCausalLM",
              tiny="fastdeploy_ext.models.minimax_m1.tiny:write_tiny_minimax_hf", **_COMMON),
]
