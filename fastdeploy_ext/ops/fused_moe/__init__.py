"""Fused MoE expert block: ``fused_moe`` (Triton, torch or Paddle tensors), its float64 NumPy definition
``fused_moe_reference`` and the device backend's ``select_moe_impl``. README.md has the math and the layout."""

from fastdeploy_ext.ops.fused_moe.reference import fused_moe_reference
from fastdeploy_ext.ops.fused_moe.selection import select_moe_impl


def __getattr__(name):
    # Triton is imported on first use, so that the reference and the selection work without it.
    if name in ("fused_moe", "GemmConfig", "MoEConfig", "default_config"):
        from fastdeploy_ext.ops.fused_moe import launcher

        return getattr(launcher, name)
    raise AttributeError(f"module 'fastdeploy_ext.ops.fused_moe' has no attribute {name!r}")


__all__ = ["GemmConfig", "MoEConfig", "default_config", "fused_moe", "fused_moe_reference", "select_moe_impl"]
