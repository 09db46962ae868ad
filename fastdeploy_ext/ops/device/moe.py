"""The device backend of ``FusedMoE`` (``layers/moe.py``): routing in Paddle ops
(:func:`fastdeploy_ext.ops.moe_routing.route`), then an experts callable ``(x, top_i, top_w) -> [T, hidden]``:
:class:`TritonExperts` (the fused-MoE Triton kernel) or :class:`SortedDispatch` (plain Paddle ops, no host sync, the
same code on CPU and GPU). The host backend's is ``fastdeploy_ext/ops/host/moe.py``.
"""

from __future__ import annotations

import paddle
from paddle.nn import functional as F

from fastdeploy_ext.ops.moe_routing import route


class DeviceMoE:
    """The device backend: routing in max(float32, compute dtype), then ``experts(x, top_i, top_w)``. Parameters
    are read at call time, so there is nothing to prepare after loading or to drop when a loader writes."""

    def __init__(self, top_k: int, renormalize: bool, accum: str, experts):
        self.top_k, self.renormalize, self.accum, self.experts = top_k, renormalize, accum, experts

    def __call__(self, x: paddle.Tensor, gate) -> paddle.Tensor:
        top_i, top_w = route(gate(x.astype(self.accum)), self.top_k, self.renormalize)
        return self.experts(x, top_i, top_w)

    def process_weights_after_loading(self) -> None:
        pass

    def weights_changed(self) -> None:
        pass


# Elements of one expert-major padded buffer ([E, tokens, max(hidden, 2 * inter)]): tokens are dispatched in
# chunks that keep it within this bound (64 Mi elements: 128 MiB in bf16).
_PAD_ELEMENTS = 1 << 26


class SortedDispatch:
    """Experts over an expert-major padded layout in plain Paddle ops, with no host-side counts: a token picks an
    expert at most once, so ``T`` rows per expert always suffice and every shape depends only on the host-known
    ``T``. Pairs ``p = (token p // k, expert top_i.flat[p])`` are sorted by expert (stable); a pair's row in its
    expert's segment is its distance from the first sorted pair of that expert (``searchsorted``: Paddle's
    ``bincount`` sizes its output by copying the largest id to the host, a sync). Rows are scattered into
    ``[E, T, hidden]``, both projections run as one ``bmm`` each against the stacked weights, and each token's
    ``k`` outputs are gathered back and summed with their routing weights in the routing dtype.

    Padding costs ``E / k`` times the matmul work of exact segments (nothing reads a padded row's output);
    ``weights()`` returns ``(up_gate, down)`` in the compute dtype."""

    def __init__(self, num_experts: int, top_k: int, hidden: int, width: int, accum: str, weights):
        self.num_experts, self.top_k, self.accum, self.weights = num_experts, top_k, accum, weights
        self.tokens_per_chunk = max(1, _PAD_ELEMENTS // (num_experts * max(hidden, width)))

    def __call__(self, x: paddle.Tensor, top_i: paddle.Tensor, top_w: paddle.Tensor) -> paddle.Tensor:
        up_gate, down = self.weights()
        step = self.tokens_per_chunk
        parts = [self._chunk(x[s:s + step], top_i[s:s + step], top_w[s:s + step], up_gate, down)
                 for s in range(0, x.shape[0], step)]
        return parts[0] if len(parts) == 1 else paddle.concat(parts)

    def _chunk(self, x, top_i, top_w, up_gate, down) -> paddle.Tensor:
        (t, hidden), k, e = x.shape, self.top_k, self.num_experts
        flat = top_i.reshape([-1])
        order = paddle.argsort(flat, stable=True)
        sorted_e = paddle.gather(flat, order)
        rank = paddle.arange(t * k, dtype="int64") - paddle.searchsorted(sorted_e, sorted_e)
        slot = paddle.scatter(paddle.zeros_like(flat), order, sorted_e * t + rank)
        rows = paddle.zeros([e * t, hidden], x.dtype)
        rows.scatter_(slot, x.unsqueeze(1).expand([t, k, hidden]).reshape([t * k, hidden]))
        h = paddle.bmm(rows.reshape([e, t, hidden]), up_gate)
        y = paddle.bmm(F.swiglu(h), down).reshape([e * t, hidden])
        picked = paddle.gather(y, slot).reshape([t, k, hidden]).astype(self.accum)
        return (picked * top_w.unsqueeze(-1)).sum(axis=1).astype(x.dtype)


class TritonExperts:
    """``fastdeploy_ext.ops.fused_moe.fused_moe`` on the stacked parameters as stored: float experts in the
    activation dtype, or wint8 codes with their ``[E, 1, out]`` float32 scales."""

    def __init__(self, stacked: tuple, scales: tuple):
        from fastdeploy_ext.ops.fused_moe import fused_moe

        self.fused_moe, self.stacked, self.scales = fused_moe, stacked, scales

    def __call__(self, x: paddle.Tensor, top_i: paddle.Tensor, top_w: paddle.Tensor) -> paddle.Tensor:
        (up_gate, down), (up_gate_scale, down_scale) = self.stacked, self.scales
        return self.fused_moe(x, up_gate, down, top_i.contiguous(), top_w.contiguous(), up_gate_scale=up_gate_scale,
                              down_scale=down_scale)
