"""The host backend: CPU-speed implementations in NumPy, MKL (ctypes) and host threads.

Everything here works on host arrays or on Paddle CPU float32 tensors through zero-copy DLPack views. Layers get
these implementations once, at construction, from ``layers/backend.py`` when ``fd_config.load_config.backend ==
"host"``; ``fastdeploy_ext/ops/device`` holds the device backend's modules of the same names (docs/architecture.md
"Backends"). Only the load-time weight copy (``copy.py``) also serves the device backend's CPU parameters.

A host op's result carries its NumPy view (:func:`new_tensor`, :func:`as_tensor`), so the next host op reads it
without another DLPack round trip. In a batch-1 decode step every op runs right after a product that streamed MBs
of weights through the caches, and there a DLPack view costs ~30 us, a Paddle op or ``paddle.empty`` ~45-65 us,
against ~2 us for the stored view (``benchmarks/profile_decode.py``, docs/benchmarks.md).
"""

import numpy as np
import paddle
from paddle import _C_ops
from paddle.utils import dlpack

# The attribute of a host op's result that holds its NumPy view. Set only on activations this package creates, never
# on parameters or caches (whose memory a load or an in-place Paddle op may replace).
_VIEW = "_fdext_host_view"
_CPU = paddle.CPUPlace()


def host_view(t, keep: bool = False) -> np.ndarray:
    """A NumPy view of a Paddle CPU tensor's memory, strided views (q/k/v columns of a fused projection)
    included: DLPack carries the strides. Writes through the view land in the tensor. (Paddle's
    ``contiguous()`` of a small strided tensor took 1.2 ms per call on a busy 2-core box: 57 ms of a
    24-layer decode step.) ``keep`` stores the view on the tensor for the next call: only for tensors whose
    memory and shape stay for their lifetime, as the runner's caches."""
    view = getattr(t, _VIEW, None)
    if view is not None:
        return view
    if not t.place.is_cpu_place():
        raise ValueError(f"the host backend runs on CPU tensors, got one on {t.place}")
    view = np.from_dlpack(t if t.stop_gradient else t.detach())  # detach shares the memory
    if keep:
        setattr(t, _VIEW, view)
    return view


def new_tensor(shape) -> tuple:
    """``(tensor, view)``: an uninitialised float32 CPU tensor of ``shape`` and its NumPy view, which the tensor
    carries for the host ops that read it next. (``_C_ops.empty`` is what ``paddle.empty`` calls, less its argument
    checks: ~45 against ~60 us cold.)"""
    t = _C_ops.empty(list(shape), paddle.float32, _CPU)
    view = np.from_dlpack(t)
    setattr(t, _VIEW, view)
    return t, view


def as_tensor(a: np.ndarray):
    """A Paddle tensor sharing the memory of the NumPy array ``a``, carrying ``a`` as its view."""
    t = dlpack.from_dlpack(a)
    setattr(t, _VIEW, a)
    return t
