"""The device backend: Paddle ops, and the Triton kernels of ``fastdeploy_ext/ops/*/launcher.py``, on any device and
dtype (CPU float32/float64, GPU bf16/fp16/float32).

Each module mirrors its host twin in ``fastdeploy_ext/ops/host`` (same name, same call surface), so a layer holds
either one; ``fastdeploy_ext/layers/backend.py`` picks between them once, at construction
(docs/architecture.md "Backends").
"""
