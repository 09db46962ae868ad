"""Which implementation runs a ``FusedMoE`` layer on the device backend, decided once at configuration time."""

from fastdeploy_ext.config.base import ConfigError

__all__ = ["TRITON_EXPERT_FORMATS", "select_moe_impl", "up_half_aligned"]

# None: float experts (the activation dtype); "wint8": int8 codes with per-column float32 scales.
TRITON_EXPERT_FORMATS = (None, "wint8")
_OTHER_FORMATS = ("wint4", "gptq", "fp8")


def up_half_aligned(inter: int, element_size: int) -> bool:
    """The kernel reads the up half of ``up_gate_w`` from column ``inter`` by TMA, whose tiles must start on a
    16-byte boundary of the row (the interpreter refuses others; the GPU path keeps the same accepted shapes)."""
    return inter * element_size % 16 == 0


def select_moe_impl(on_gpu: bool, activation_dtype: str, expert_format, *, layer: str = "",
                    intermediate_size: int | None = None) -> str:
    """``"triton"`` (``fused_moe``) on a GPU with bfloat16 activations and float or wint8 experts; ``"paddle"``
    (the layer's Paddle-op dispatch) on the CPU, whatever the format (it dequantizes one expert at a time), and
    on a GPU with float32/float16 activations and float or wint8 experts. wint4, GPTQ and FP8 experts on a GPU
    have no grouped kernel here: a :class:`ConfigError` naming ``layer`` says to dequantize them first.
    ``activation_dtype``: a dtype or its name (``"bfloat16"``, ``paddle.bfloat16``, ``torch.bfloat16``).
    ``intermediate_size`` (per rank): the kernel reads the up half of ``up_gate_w`` from column ``inter`` by TMA,
    which needs that column 16 bytes into a row; other widths take the Paddle dispatch."""
    dtype = str(activation_dtype).rsplit(".", 1)[-1]
    if expert_format not in TRITON_EXPERT_FORMATS + _OTHER_FORMATS:
        raise ConfigError(f"'{layer}': unknown expert format {expert_format!r} (expected float (None), "
                          f"{', '.join(f for f in TRITON_EXPERT_FORMATS + _OTHER_FORMATS if f)})")
    if not on_gpu:
        return "paddle"
    if expert_format in _OTHER_FORMATS:
        raise ConfigError(f"'{layer}': {expert_format} experts have no fused MoE kernel on the GPU; dequantize them "
                          "at load (list the layer in skip_modules / modules_to_not_convert) or quantize with wint8")
    if intermediate_size is not None and not up_half_aligned(intermediate_size, 1 if expert_format == "wint8" else 2):
        return "paddle"
    return "triton" if dtype == "bfloat16" else "paddle"
