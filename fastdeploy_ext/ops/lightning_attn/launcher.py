"""Run the Triton kernels on Paddle tensors (fastdeploy_conventions.md §9, environment.md §7).

Triton's launcher only needs ``data_ptr()`` and a dtype whose name ends in a Triton type name, which
Paddle tensors have. What Paddle lacks is torch, which Triton's CUDA driver imports for the current
device and stream, and which the CPU interpreter uses to copy arguments to the host:

- GPU, torch not installed: ``paddle.enable_compat(scope={"triton"})`` once, so ``import torch`` inside
  Triton resolves to Paddle and kernels run on Paddle's current stream.
- GPU, torch installed: the same redirection only around each launch (``paddle.use_compat_guard``), so
  torch code elsewhere in the process keeps the real torch.
- CPU under ``TRITON_INTERPRET=1``: with torch, hand Triton zero-copy ``torch.from_dlpack`` views; without
  torch, :func:`patch_interpreter_for_host_tensors` makes the interpreter use the tensors as they are.

This module imports Paddle lazily so that ``triton_kernels`` imports without Paddle installed.
"""

import importlib.util
import os

import numpy as np

__all__ = [
    "PaddleOps",
    "interpreter_enabled",
    "is_paddle_tensor",
    "patch_interpreter_for_host_tensors",
    "patch_interpreter_scalar_index",
    "torch_installed",
]

_GLOBAL_COMPAT_ENABLED = False
_INTERPRETER_PATCHED = False
_INDEX_PATCHED = False


def is_paddle_tensor(x):
    """True for a ``paddle.Tensor`` without importing Paddle."""
    return type(x).__module__.startswith("paddle") and hasattr(x, "place")


def torch_installed():
    """True when torch can be imported (a ``sys.modules['torch'] = None`` block counts as absent)."""
    try:
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):
        return False


def patch_interpreter_for_host_tensors():
    """Let ``TRITON_INTERPRET=1`` run on Paddle CPU tensors when torch is not installed.

    The interpreter copies every tensor argument to a host buffer through torch storage APIs before a
    launch and back afterwards. CPU tensors already live in host memory, so both copies are replaced
    by the identity. These are private Triton APIs (checked on Triton 3.6.0): keep CI on that version.
    """
    global _INTERPRETER_PATCHED
    if _INTERPRETER_PATCHED:
        return
    from triton.runtime import interpreter

    def _init_args_hst(self, args_dev, kwargs):
        return args_dev, kwargs

    def _restore_args_dev(self, args_dev, args_hst, kwargs, kwargs_hst):
        return None

    interpreter.GridExecutor._init_args_hst = _init_args_hst
    interpreter.GridExecutor._restore_args_dev = _restore_args_dev
    _INTERPRETER_PATCHED = True


def patch_interpreter_scalar_index():
    """Make loop bounds loaded from memory usable under ``TRITON_INTERPRET=1`` with NumPy >= 2.4.

    The Triton 3.6 interpreter stores a scalar loaded with ``tl.load`` as a one-element 1-D array and
    converts it for ``range(start, end, step)`` with ``int(array)``, which NumPy 2.4 rejects. Wrap the
    interpreter's tensor patching so that ``__index__`` uses ``.item()``. Private API, Triton 3.6.0.
    """
    global _INDEX_PATCHED
    if _INDEX_PATCHED:
        return
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def _patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    interpreter._patch_lang_tensor = _patch_lang_tensor
    _INDEX_PATCHED = True


class PaddleOps:
    """Framework hooks used by ``triton_kernels`` for Paddle tensors (allocation, host copies, launch)."""

    name = "paddle"

    def __init__(self):
        import paddle

        self.paddle = paddle

    def owns(self, t):
        return is_paddle_tensor(t)

    def is_cuda(self, t):
        return t.place.is_gpu_place()

    def is_cpu(self, t):
        return t.place.is_cpu_place()

    def device_key(self, t):
        return str(t.place)

    def to_host(self, t):
        return np.asarray(t.numpy())

    def from_host(self, array, like):
        return self.paddle.to_tensor(array, place=like.place)

    def empty(self, shape, dtype_name, like):
        return self.paddle.empty(list(shape), dtype=dtype_name, device=like.place)

    def num_sms(self, t):
        if not self.is_cuda(t):
            return None
        return self.paddle.device.cuda.get_device_properties(t.place.gpu_device_id()).multi_processor_count

    def capability(self, t):
        """``(major, minor)`` of a GPU tensor's device, None elsewhere (the CPU interpreter included)."""
        if not self.is_cuda(t) or interpreter_enabled():
            return None
        return tuple(self.paddle.device.cuda.get_device_capability(t.place.gpu_device_id()))

    def is_capturing(self, t):
        # Paddle exposes no per-stream "is capturing" query; callers that capture CUDA graphs pass
        # check_slots=False (documented on lightning_attn_decode).
        return False

    def launch(self, kernel, grid, args, **meta):
        if self.is_cpu(_first_tensor(args)):
            patch_interpreter_scalar_index()
            if torch_installed():
                import torch

                args = [torch.from_dlpack(a) if is_paddle_tensor(a) else a for a in args]
            else:
                patch_interpreter_for_host_tensors()
            kernel[grid](*args, **meta)
            return
        if torch_installed():
            with self.paddle.use_compat_guard(enable=True, scope={"triton"}, silent=True):
                kernel[grid](*args, **meta)
            return
        _enable_global_compat(self.paddle)
        kernel[grid](*args, **meta)


def _enable_global_compat(paddle):
    global _GLOBAL_COMPAT_ENABLED
    if not _GLOBAL_COMPAT_ENABLED:
        paddle.enable_compat(scope={"triton"}, silent=True)
        _GLOBAL_COMPAT_ENABLED = True


def _first_tensor(args):
    for a in args:
        if is_paddle_tensor(a):
            return a
    raise ValueError("a kernel launch needs at least one tensor argument")


def interpreter_enabled():
    """True when Triton kernels run on the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
