"""Paged causal GQA attention: ``paged_decode`` and ``paged_prefill`` (Triton, torch or Paddle tensors), their float64
NumPy definition ``paged_attention_reference`` and the device backend's ``select_attention_impl``. README.md has the
math and the layout."""

from fastdeploy_ext.ops.paged_attention.configs import (DecodeConfig, PrefillConfig, decode_splits,
                                                        decode_workspace_bytes, default_decode_config,
                                                        default_prefill_config)
from fastdeploy_ext.ops.paged_attention.reference import paged_attention_reference, paged_decode_reference
from fastdeploy_ext.ops.paged_attention.selection import KERNELS_ENV, select_attention_impl


def __getattr__(name):
    # Triton is imported on first use, so that the reference and the selection work without it.
    if name in ("paged_decode", "paged_prefill"):
        from fastdeploy_ext.ops.paged_attention import launcher

        return getattr(launcher, name)
    raise AttributeError(f"module 'fastdeploy_ext.ops.paged_attention' has no attribute {name!r}")


__all__ = ["KERNELS_ENV", "DecodeConfig", "PrefillConfig", "decode_splits", "decode_workspace_bytes",
           "default_decode_config", "default_prefill_config", "paged_decode", "paged_prefill",
           "paged_attention_reference", "paged_decode_reference", "select_attention_impl"]
