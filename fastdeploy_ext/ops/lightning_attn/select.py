"""Which lightning ops the device backend's layer calls, decided once when the layer is built."""

from fastdeploy_ext.ops.lightning_attn import reference

# "triton" forces the Triton kernels wherever the device backend runs (a CPU needs TRITON_INTERPRET=1 and float32);
# "reference" forces the readable Paddle reference.
KERNELS_ENV = "FDEXT_LIGHTNING_KERNELS"


def select_lightning_ops(block_size: int, on_gpu: bool, kernels: str = ""):
    """``(prefill, decode, dtypes they take)`` for the device backend, chosen once at construction: the Triton
    kernels on a GPU or when ``kernels == "triton"``, the Paddle reference otherwise (or when ``"reference"``).
    Both take the contract's arguments plus the runner's host ``cu_seqlens`` and ``check_slots=False``: the
    runner checked the slots once per step, so neither waits for the device."""
    if kernels not in ("", "triton", "reference"):
        raise ValueError(f"{KERNELS_ENV} must be 'triton' or 'reference', got {kernels!r}")
    if kernels == "triton" or (kernels == "" and on_gpu):
        try:
            import triton  # noqa: F401
        except ImportError:
            from fastdeploy_ext.config.base import ConfigError

            why = f"{KERNELS_ENV}=triton" if kernels == "triton" else "the GPU lightning-attention kernels"
            raise ConfigError(f"{why} needs Triton, which is not installed: pip install -e \".[triton]\" "
                              "(the triton extra)") from None
        from fastdeploy_ext.ops.lightning_attn import triton_kernels

        def prefill_triton(q, k, v, slopes, cu_seqlens, state_pool, slot_ids, cu_seqlens_cpu):
            # The kernels tile their own chunks (16..128 tokens); the block size only changes rounding.
            return triton_kernels.lightning_attn_prefill(q, k, v, slopes, cu_seqlens, state_pool, slot_ids,
                                                         cu_seqlens_cpu=cu_seqlens_cpu, check_slots=False)

        def decode_triton(q, k, v, slopes, state_pool, slot_ids):
            return triton_kernels.lightning_attn_decode(q, k, v, slopes, state_pool, slot_ids, check_slots=False)

        return prefill_triton, decode_triton, ("float32", "bfloat16")

    def prefill(q, k, v, slopes, cu_seqlens, state_pool, slot_ids, cu_seqlens_cpu):
        return reference.lightning_attn_prefill(q, k, v, slopes, cu_seqlens, state_pool, slot_ids, block_size=block_size,
                                                cu_seqlens_cpu=cu_seqlens_cpu, check_slots=False)

    def decode(q, k, v, slopes, state_pool, slot_ids):
        return reference.lightning_attn_decode(q, k, v, slopes, state_pool, slot_ids, check_slots=False)

    return prefill, decode, ("float32", "float64")
