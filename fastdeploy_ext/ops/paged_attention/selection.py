"""Which implementation the device backend's softmax attention runs, decided once when the layer is built."""

__all__ = ["KERNELS_ENV", "KERNEL_DTYPES", "select_attention_impl"]

# "triton" forces the kernels wherever the device backend runs (a CPU needs TRITON_INTERPRET=1 and float32);
# "paddle" forces the Paddle-op path.
KERNELS_ENV = "FDEXT_ATTENTION_KERNELS"
# Operand dtypes the kernels take on a GPU (float32 too when forced: IEEE dots, slow).
KERNEL_DTYPES = ("bfloat16", "float16")


def select_attention_impl(on_gpu: bool, dtype: str, kernels: str = "") -> str:
    """``"triton"`` (``paged_decode``/``paged_prefill``) on a GPU for bfloat16/float16, or when ``kernels ==
    "triton"`` for float32 (float64 has no kernel); ``"paddle"`` otherwise (the CPU, float32/float64, or
    ``kernels == "paddle"``). ``dtype``: the cache and activation dtype's name."""
    if kernels not in ("", "triton", "paddle"):
        raise ValueError(f"{KERNELS_ENV} must be 'triton' or 'paddle', got {kernels!r}")
    if kernels == "triton":
        if dtype not in KERNEL_DTYPES + ("float32",):
            raise ValueError(f"{KERNELS_ENV}=triton: the kernels take bfloat16, float16 or float32, not {dtype}")
        return "triton"
    if kernels == "" and on_gpu and dtype in KERNEL_DTYPES:
        return "triton"
    return "paddle"
