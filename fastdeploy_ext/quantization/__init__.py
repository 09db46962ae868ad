"""Weight-only quantization: online ``wint8``/``wint4`` and pre-quantized GPTQ (w4a16) / block-wise FP8
checkpoints. See docs/quantization.md."""

from fastdeploy_ext.quantization.config import resolve_quant_config
from fastdeploy_ext.quantization.memory import describe_weight_bytes, model_weight_bytes
from fastdeploy_ext.quantization.methods import (
    CHECKPOINT_METHODS,
    ONLINE_METHODS,
    check_weight_only_gpu,
    get_moe_quant_method,
    get_quant_method,
)

__all__ = ["CHECKPOINT_METHODS", "ONLINE_METHODS", "check_weight_only_gpu", "describe_weight_bytes",
           "get_moe_quant_method", "get_quant_method", "model_weight_bytes", "resolve_quant_config"]
