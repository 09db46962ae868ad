from fastdeploy_ext.model_loader.safetensors_loader import (
    LazyTensor,
    check_all_loaded,
    iterate_checkpoint,
)

__all__ = ["LazyTensor", "check_all_loaded", "iterate_checkpoint"]
