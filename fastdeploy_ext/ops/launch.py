"""Launch Triton kernels on torch or Paddle tensors: the one adapter every op's launcher uses
(``ops/fused_moe/launcher.py``, ``ops/lightning_attn/triton_kernels.py``, ``ops/paged_attention/launcher.py``,
``ops/sampling/launcher.py``), with the argument checks they share (docs/gpu.md has the GPU side).

torch tensors launch directly (:class:`TorchOps`). Triton's launcher only needs ``data_ptr()`` and a dtype whose
name ends in a Triton type name, which Paddle tensors have; what Paddle lacks is torch, which Triton's CUDA driver
imports for the current device and stream, and which the CPU interpreter uses to copy arguments to the host
(:class:`PaddleOps`):

- GPU, torch not installed: ``paddle.enable_compat(scope={"triton"})`` once, so ``import torch`` inside
  Triton resolves to Paddle and kernels run on Paddle's current stream.
- GPU, torch installed: the same redirection only around each launch (``paddle.use_compat_guard``), so
  torch code elsewhere in the process keeps the real torch.
- CPU under ``TRITON_INTERPRET=1``: with torch, hand Triton zero-copy ``torch.from_dlpack`` views; without
  torch, :func:`patch_interpreter_for_host_tensors` makes the interpreter use the tensors as they are.

Imports neither framework at import time, so that kernel modules import without Paddle or torch installed.
"""

import importlib.util
import os

import numpy as np

__all__ = [
    "PaddleOps",
    "TorchOps",
    "check_device",
    "check_tensor",
    "dtype_name",
    "interpreter_enabled",
    "is_paddle_tensor",
    "ops_for",
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

    def desc_base(self, t):
        """A TMA descriptor's base. A descriptor is no top-level argument, so :meth:`launch` cannot swap it for a torch
        view, and ``TensorDescriptor`` reads ``dtype.itemsize``, which Paddle dtypes lack: a zero-copy torch view, or
        without torch a stand-in with the tensor's address and dtype."""
        if torch_installed():
            import torch

            return torch.from_dlpack(t)
        return _PaddleBase(t)

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


class _PaddleBase:
    def __init__(self, t):
        self.tensor, self.dtype = t, _PaddleDtype(t.dtype, t.element_size())

    def data_ptr(self):
        return self.tensor.data_ptr()


class _PaddleDtype:
    def __init__(self, dtype, itemsize):
        self.dtype, self.itemsize = dtype, itemsize

    def __str__(self):
        return str(self.dtype)


class TorchOps:
    """The same framework hooks for torch tensors."""

    name = "torch"

    def __init__(self):
        import torch

        self.torch = torch

    def owns(self, t):
        return isinstance(t, self.torch.Tensor)

    def is_cuda(self, t):
        return t.device.type == "cuda"

    def is_cpu(self, t):
        return t.device.type == "cpu"

    def device_key(self, t):
        return t.device

    def to_host(self, t):
        return t.detach().cpu().numpy()

    def from_host(self, array, like):
        return self.torch.from_numpy(np.ascontiguousarray(array)).to(like.device)

    def empty(self, shape, dtype_name, like):
        return self.torch.empty(tuple(shape), dtype=getattr(self.torch, dtype_name), device=like.device)

    def num_sms(self, t):
        if not self.is_cuda(t):
            return None
        return self.torch.cuda.get_device_properties(t.device).multi_processor_count

    def capability(self, t):
        if not self.is_cuda(t) or interpreter_enabled():
            return None
        return tuple(self.torch.cuda.get_device_capability(t.device))

    def is_capturing(self, t):
        return self.is_cuda(t) and self.torch.cuda.is_current_stream_capturing()

    def desc_base(self, t):
        return t

    def launch(self, kernel, grid, args, **meta):
        if interpreter_enabled():
            patch_interpreter_scalar_index()
        kernel[grid](*args, **meta)


def ops_for(t, name: str):
    """The hooks for ``t``'s framework; ``name`` is the argument's name in the error for anything else."""
    if is_paddle_tensor(t):
        return PaddleOps()
    if type(t).__module__.startswith("torch"):
        return TorchOps()
    raise ValueError(f"{name} must be a torch.Tensor or paddle.Tensor, got {type(t).__name__}")


_DTYPE_NAMES = {}


def dtype_name(t) -> str:
    """``"float32"``, ``"bfloat16"``, ... for a torch or Paddle tensor (their dtypes print differently)."""
    name = _DTYPE_NAMES.get(t.dtype)
    if name is None:
        name = _DTYPE_NAMES[t.dtype] = str(t.dtype).rsplit(".", 1)[-1]
    return name


def check_device(ops, t, name: str) -> None:
    """The kernels run on a CUDA device, or on the CPU under the interpreter."""
    if not ops.is_cuda(t) and not (ops.is_cpu(t) and interpreter_enabled()):
        raise ValueError(f"{name} is on {ops.device_key(t)}: the kernels need a CUDA device, or CPU tensors with "
                         "TRITON_INTERPRET=1")


def check_tensor(ops, t, name: str, like, like_name: str) -> None:
    """``t`` (argument ``name``) is a contiguous tensor of ``like``'s framework on ``like``'s device."""
    if not ops.owns(t):
        raise ValueError(f"{name} must be a {ops.name} tensor like {like_name}, got {type(t).__name__}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if ops.device_key(t) != ops.device_key(like):
        raise ValueError(f"{name} is on {ops.device_key(t)} but {like_name} is on {ops.device_key(like)}")
