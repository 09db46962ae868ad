"""The host backend: CPU-speed implementations in NumPy, MKL (ctypes) and host threads.

Everything here works on host arrays or on Paddle CPU float32 tensors through zero-copy DLPack views. Layers get
these implementations once, at construction, from ``layers/backend.py`` when ``fd_config.load_config.backend ==
"host"``; ``fastdeploy_ext/ops/device`` holds the device backend's modules of the same names (docs/architecture.md
"Backends"). Only the load-time weight copy (``copy.py``) also serves the device backend's CPU parameters.
"""

import numpy as np


def host_view(t) -> np.ndarray:
    """A NumPy view of a Paddle CPU tensor's memory, strided views (q/k/v columns of a fused projection)
    included: DLPack carries the strides. Writes through the view land in the tensor. (Paddle's
    ``contiguous()`` of a small strided tensor took 1.2 ms per call on a busy 2-core box: 57 ms of a
    24-layer decode step.)"""
    if not t.place.is_cpu_place():
        raise ValueError(f"the host backend runs on CPU tensors, got one on {t.place}")
    return np.from_dlpack(t if t.stop_gradient else t.detach())  # detach shares the memory
