"""The host backend: CPU-speed implementations in NumPy, MKL (ctypes) and host threads.

Everything here works on host arrays or on Paddle CPU float32 tensors through zero-copy DLPack views. Layers get
these implementations once, at construction, from ``layers/backend.py`` when ``fd_config.load_config.backend ==
"host"``; ``fastdeploy_ext/ops/device`` holds the device backend's modules of the same names (docs/architecture.md
"Backends"). Only the load-time weight copy (``copy.py``) also serves the device backend's CPU parameters.

A host op's result carries its NumPy view (:func:`new_tensor`, :func:`as_tensor`), so the next host op reads it
without another DLPack round trip. In a batch-1 decode step every op runs right after a product that streamed MBs
of weights through the caches, and there a DLPack view costs ~30 us, a Paddle op or ``paddle.empty`` ~45-65 us,
against ~2 us for the stored view (``benchmarks/profile_decode.py``, docs/benchmarks.md).

For the same reason a model runs its decoder layers inside a :class:`StepScratch`: there :func:`new_tensor` hands
out the tensors of the previous pass again, in the same order, when their shapes repeat (every decode step).
"""

import contextvars

import numpy as np
import paddle
from paddle import _C_ops
from paddle.utils import dlpack

# The attribute of a host op's result that holds its NumPy view. Set only on activations this package creates, never
# on parameters or caches (whose memory a load or an in-place Paddle op may replace).
_VIEW = "_fdext_host_view"
# A parameter's view and the address it was made for (``param_view``).
_PARAM_VIEW = "_fdext_param_view"
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


def param_view(p) -> np.ndarray:
    """A NumPy view of a CPU parameter, kept on it with the address it was made for and made again where the
    parameter's memory has moved (a load that shares a checkpoint's mapped pages, ``set_value``). Checking the
    address costs ~12 us right after a weight-streaming product, a new DLPack view ~37 us."""
    kept = getattr(p, _PARAM_VIEW, None)
    address = p.data_ptr()
    if kept is not None and kept[0] == address:
        return kept[1]
    view = host_view(p)
    setattr(p, _PARAM_VIEW, (address, view))
    return view


def new_tensor(shape) -> tuple:
    """``(tensor, view)``: an uninitialised float32 CPU tensor of ``shape`` and its NumPy view, which the tensor
    carries for the host ops that read it next; inside a :class:`StepScratch`, possibly one of its tensors."""
    scratch = _scratch.get()
    if scratch is not None:
        return scratch.take(tuple(shape))
    return _fresh_tensor(shape)


def _fresh_tensor(shape) -> tuple:
    # ``_C_ops.empty`` is what ``paddle.empty`` calls, less its argument checks: ~45 against ~60 us cold.
    t = _C_ops.empty(list(shape), paddle.float32, _CPU)
    view = np.from_dlpack(t)
    setattr(t, _VIEW, view)
    return t, view


_scratch: contextvars.ContextVar = contextvars.ContextVar("fdext_host_scratch", default=None)


class StepScratch:
    """Result tensors of the host ops inside one ``with`` block (a model's pass over its decoder layers), handed
    out again by :func:`new_tensor` in the next pass: the ``i``-th request of a pass gets the ``i``-th tensor of
    the last, when the shape is the same. A tensor made in a pass is valid until the next pass begins, so
    nothing made inside may outlive its pass (the caches are written by copy; the model's final norm runs
    outside). Making a Paddle tensor and its view right after a product that streamed weights through the caches
    costs ~60 us; a Qwen2-0.5B decode step makes ~240 of them (benchmarks/profile_decode.py, docs/benchmarks.md).

    Tensors above ``max_bytes`` (a prefill's activations) are never kept, nor any once the kept ones reach
    ``budget`` bytes; the per-thread context (``contextvars``) leaves the host-thread pool's work outside."""

    def __init__(self, max_bytes: int = 1 << 20, budget: int = 64 << 20):
        self.max_bytes, self.budget = max_bytes, budget
        self._slots: list = []
        self._bytes = 0
        self._next = 0
        self._tokens: list = []

    def __enter__(self):
        self._next = 0
        self._tokens.append(_scratch.set(self))
        return self

    def __exit__(self, *exc) -> None:
        _scratch.reset(self._tokens.pop())

    def take(self, shape: tuple) -> tuple:
        i = self._next
        self._next = i + 1
        slots = self._slots
        if i < len(slots) and slots[i] is not None and slots[i][1].shape == shape:
            return slots[i]
        made = _fresh_tensor(shape)
        nbytes = made[1].nbytes
        old = slots[i][1].nbytes if i < len(slots) and slots[i] is not None else 0
        if nbytes > self.max_bytes or self._bytes - old + nbytes > self.budget:
            return made
        if i >= len(slots):
            slots.extend([None] * (i + 1 - len(slots)))
        slots[i] = made
        self._bytes += nbytes - old
        return made


def as_tensor(a: np.ndarray):
    """A Paddle tensor sharing the memory of the NumPy array ``a``, carrying ``a`` as its view."""
    t = dlpack.from_dlpack(a)
    setattr(t, _VIEW, a)
    return t
