"""The host backend of ``FusedMoE`` (CPU float32): routing and dispatch bookkeeping in NumPy, experts against
MKL-packed weights (:mod:`fastdeploy_ext.ops.host.cpu_gemm`) or Paddle matmuls over NumPy-built segments.

The layer (``layers/moe.py``) builds a :class:`HostMoE` at construction on the host backend and calls
:meth:`HostMoE.process_weights_after_loading` after loading and :meth:`HostMoE.weights_changed` from its loader.
"""

from __future__ import annotations

import numpy as np
import paddle

from fastdeploy_ext.ops.host import as_tensor, cpu_gemm, host_view
from fastdeploy_ext.ops.host_threads import run_chunked
from fastdeploy_ext.ops.moe_routing import route

# Padding rows a batched expert matmul may add (see HostMoE._forward_segments).
_MAX_PAD_ROWS = 256


class HostMoE:
    """``(x [T, hidden] float32, gate) -> [T, hidden]`` before the all-reduce.

    ``stacked``: the layer's float ``(up_gate [E, hidden, 2I], down [E, I, hidden])`` parameters, or None for
    quantized experts; ``expert_weight(i, e)``: expert ``e``'s float32 ``[in, out]`` weight of projection ``i``
    (0: up_gate, 1: down). Experts run against MKL-packed copies of ``stacked`` once
    :meth:`process_weights_after_loading` packed them, else through Paddle's matmul.
    """

    def __init__(self, num_experts: int, top_k: int, renormalize: bool, stacked, expert_weight):
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.stacked, self.expert_weight = stacked, expert_weight
        self.packed = None
        self._experts = self._forward_segments

    def process_weights_after_loading(self) -> None:
        """Pack every expert's weights once (a copy of them) when they are float32 on the CPU and Paddle's build
        has MKL; quantized or not-yet-materialised (``paddle.LazyGuard``) experts keep Paddle's matmul."""
        self.weights_changed()
        if self.stacked is not None and cpu_gemm.available() and all(w.place.is_cpu_place() for w in self.stacked):
            self.packed = [cpu_gemm.PackedWeights(w.numpy()) for w in self.stacked]
            self._experts = self._forward_packed_tensor

    def weights_changed(self) -> None:
        """A loader wrote an expert: drop the stale pack."""
        self.packed = None
        self._experts = self._forward_segments

    def __call__(self, x: paddle.Tensor, gate) -> paddle.Tensor:
        # The routing is tiny ([T, E]): it runs on the host, and so does the dispatch bookkeeping.
        top_i, top_w = route(host_view(gate(x)), self.top_k, self.renormalize)
        return self._experts(x, top_i, top_w)

    def _forward_packed_tensor(self, x: paddle.Tensor, top_i: np.ndarray, top_w: np.ndarray) -> paddle.Tensor:
        return as_tensor(self._forward_packed(host_view(x), top_i, top_w))

    def _forward_packed(self, x: np.ndarray, top_i: np.ndarray, top_w: np.ndarray) -> np.ndarray:
        """The dispatch in NumPy against the packed experts, in exact segments (padding paid for fewer calls;
        a call against a packed weight costs no repacking): pairs sorted by expert (stable) are the rows of
        one buffer, every expert's product is written into its rows, and the inverse permutation sums each
        token's pairs."""
        up_gate, down = self.packed
        flat = top_i.reshape(-1)
        order = np.argsort(flat, kind="stable")
        dest = np.empty_like(order)
        dest[order] = np.arange(order.shape[0])
        bounds = np.concatenate([[0], np.cumsum(np.bincount(flat, minlength=self.num_experts))])
        experts = range(self.num_experts)
        rows = np.take(x, order // self.top_k, axis=0)
        h = np.empty((rows.shape[0], up_gate.n), np.float32)
        up_gate.matmul_segments(rows, h, bounds, experts)
        act = _swiglu_scaled_host(h, top_w.reshape(-1)[order])
        y = np.empty((rows.shape[0], down.n), np.float32)
        down.matmul_segments(act, y, bounds, experts)
        return _sum_rows_host(y, dest.reshape(-1, self.top_k))

    def _forward_segments(self, x: paddle.Tensor, top_i: np.ndarray, top_w: np.ndarray) -> paddle.Tensor:
        t, k, num_experts = x.shape[0], self.top_k, self.num_experts
        flat = top_i.reshape(-1)
        counts = np.bincount(flat, minlength=num_experts)
        cap = int(counts.max())
        # Pair p = (token p // k, expert flat[p]) takes row dest[p] of its expert's segment. A small batch
        # that reaches every expert is bound by reading the expert weights: it pads every segment to the
        # busiest expert's count and runs each projection as one batched matmul over the stacked weights.
        # Otherwise segments are exact and each expert with rows gets its own matmul: a large batch is
        # compute-bound (padding would be wasted work), and a batch that skips experts must not read them.
        # Packed experts (_forward_packed) always take exact segments.
        batched = (self.stacked is not None and bool(np.all(counts))
                   and cap * num_experts <= t * k + _MAX_PAD_ROWS)
        starts = np.arange(num_experts) * cap if batched else np.cumsum(counts) - counts
        order = np.argsort(flat, kind="stable")
        dest = np.empty_like(order)
        dest[order] = np.repeat(starts, counts) + np.arange(t * k) - np.repeat(np.cumsum(counts) - counts, counts)
        num_rows = num_experts * cap if batched else t * k
        row_weights = np.zeros(num_rows, np.float32)
        row_weights[dest] = top_w.reshape(-1)
        rows = _gather_rows(x, np.arange(t * k) // k, dest, num_rows)
        segments = None if batched else (starts, counts)
        h = host_view(self._project(0, rows, segments))
        act = as_tensor(_swiglu_scaled_host(h, row_weights))
        y = host_view(self._project(1, act, segments))
        return as_tensor(_sum_rows_host(y, dest.reshape(t, k)))

    def _project(self, i: int, rows: paddle.Tensor, segments) -> paddle.Tensor:
        """Every expert's rows times its weight of projection ``i``. ``segments`` None: ``rows`` are ``E`` equal
        padded segments (one batched matmul); else ``(starts, counts)`` of exact segments, one matmul per expert
        that has rows (quantized experts are dequantized one at a time)."""
        if segments is None:
            weight = self.stacked[i]
            return paddle.bmm(rows.reshape([self.num_experts, -1, rows.shape[1]]), weight).reshape([rows.shape[0], -1])
        return paddle.concat([paddle.matmul(rows[s:s + n], self.expert_weight(i, e))
                              for e, (s, n) in enumerate(zip(*segments)) if n], axis=0)


def _gather_rows(x: paddle.Tensor, src: np.ndarray, dest: np.ndarray, num_rows: int) -> paddle.Tensor:
    """``[num_rows, hidden]`` with row ``dest[i]`` = ``x[src[i]]``; any other (padding) row is a copy of
    ``x[0]``: its routing weight is 0 and nothing reads its output. In NumPy (Paddle's CPU gather is several
    times slower than a memcpy)."""
    index = np.zeros(num_rows, np.int64)
    index[dest] = src
    return as_tensor(np.take(host_view(x), index, axis=0))


def _swiglu_scaled_host(host: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """``silu(h[:, :I]) * h[:, I:] * scale[:, None]`` (gate columns first): each pair's routing weight is
    applied to its activation, so combining pairs is a plain sum. Paddle's CPU swiglu runs at half the speed;
    split by rows over the host threads (a 4096-row prefill: 16 -> 9-12 ms per layer)."""
    inter = host.shape[1] // 2
    out = np.empty((host.shape[0], inter), host.dtype)

    def rows(c):
        gate_half, up, o = host[c, :inter], host[c, inter:], out[c]
        np.negative(gate_half, out=o)
        np.exp(o, out=o)
        o += 1.0
        np.divide(gate_half, o, out=o)
        o *= up
        o *= scale[c, None]

    run_chunked(rows, host.shape[0], host.shape[1])
    return out


def _sum_rows_host(y: np.ndarray, dest: np.ndarray) -> np.ndarray:
    """``out[t] = sum_j y[dest[t, j]]`` → ``[T, hidden]``."""
    out = np.empty((dest.shape[0], y.shape[1]), y.dtype)

    def rows(c):
        np.take(y, dest[c, 0], axis=0, out=out[c])
        for j in range(1, dest.shape[1]):
            out[c] += y[dest[c, j]]

    run_chunked(rows, dest.shape[0], y.shape[1])
    return out
