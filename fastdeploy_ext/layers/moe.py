"""Top-k routed SwiGLU experts with stacked expert weights (FastDeploy's ``FusedMoE`` surface).

``out = sum_{e in topk(x)} w_e * W_down_e (silu(W_gate_e x) * W_up_e x)`` with router probabilities
``softmax(x W_r^T)`` in fp32 and (optionally) renormalised top-k weights. Under tensor parallelism each
rank holds ``inter/tp`` columns of every expert; the partial sums are all-reduced exactly once here,
so callers must not reduce again.
"""

from __future__ import annotations

import numpy as np
import paddle
from paddle import nn
from paddle.utils import dlpack

from fastdeploy_ext.config.base import divide
from fastdeploy_ext.distributed.communication import tensor_model_parallel_all_reduce, tp_rank, tp_size
from fastdeploy_ext.layers.linear import compute_dtype
from fastdeploy_ext.layers.utils import WeightLoadError, as_float32, assign, check_shape, create_param, mark_loaded, shape_of
from fastdeploy_ext.ops.host import cpu_gemm
from fastdeploy_ext.ops.host.host_threads import run_chunked

SHARD_IDS = ("gate", "up", "down")


class FusedMoE(nn.Layer):
    """Parameters (torch-layout checkpoints are transposed on load):

    - ``up_gate_proj_weight`` ``[E, hidden, 2 * inter/tp]``: gate columns first, then up;
    - ``down_proj_weight`` ``[E, inter/tp, hidden]``.

    Both take ``weight_loader(param, w, shard_id, expert_id)`` with ``w`` one expert's torch-layout matrix
    (``gate``/``up``: ``[inter, hidden]``, ``down``: ``[hidden, inter]``), sliced lazily per rank. Quantized
    (``fd_config.quant_config.get_moe_quant_method``) both hold codes, with ``<name>_scale`` (GPTQ: also ``_zero``,
    ``_g_idx``) beside them; :meth:`checkpoint_param` routes each tensor of a pre-quantized expert.
    """

    def __init__(self, fd_config, hidden_size: int, moe_intermediate_size: int, num_experts: int, top_k: int,
                 renormalize: bool = True, reduce_results: bool = True, prefix: str = ""):
        super().__init__()
        self.fd_config = fd_config
        self.prefix = prefix
        self.tp_size, self.tp_rank = tp_size(fd_config), tp_rank(fd_config)
        self.hidden_size, self.num_experts, self.top_k = hidden_size, num_experts, top_k
        self.intermediate_size = moe_intermediate_size
        self.inter_per_rank = divide(moe_intermediate_size, self.tp_size, f"{prefix}: intermediate_size / tensor_parallel_size")
        self.renormalize, self.reduce_results = renormalize, reduce_results
        shapes = {"up_gate_proj_weight": (num_experts, hidden_size, 2 * self.inter_per_rank),
                  "down_proj_weight": (num_experts, self.inter_per_rank, hidden_size)}
        quant_config = getattr(fd_config, "quant_config", None)
        self.quant_method = None if quant_config is None else quant_config.get_moe_quant_method(self)
        if self.quant_method is not None:
            self.quant_method.create_weights(self, shapes)
        else:
            for name, shape in shapes.items():
                setattr(self, name, create_param(self, list(shape), compute_dtype(fd_config)))
        for name, shards in (("up_gate_proj_weight", ("gate", "up")), ("down_proj_weight", ("down",))):
            param = getattr(self, name)
            if self.quant_method is None:
                param.weight_loader = self.weight_loader
            else:
                param.weight_loader = self.quant_method.codes_loader(self, name)
            param.param_path = f"{prefix}.{name}"
            param.expected_shards = {f"{e}.{s}" for e in range(num_experts) for s in shards}
        self._packed = None

    def process_weights_after_loading(self) -> None:
        """On CPU with fp32 experts and MKL in Paddle's build, pack every expert's weights once for
        :mod:`fastdeploy_ext.ops.host.cpu_gemm` (a copy of the weights: loading any expert drops it again).
        Without this call, or elsewhere, experts run through Paddle's matmul."""
        self._packed = None
        weights = [getattr(self, name) for name in ("up_gate_proj_weight", "down_proj_weight")]
        if (self.quant_method is None and cpu_gemm.available()
                and all(w.place.is_cpu_place() and w.dtype == paddle.float32 for w in weights)):
            self._packed = [cpu_gemm.PackedWeights(w.numpy()) for w in weights]

    def weight_loader(self, param, loaded_weight, shard_id=None, expert_id=None):
        if shard_id not in SHARD_IDS:
            raise WeightLoadError(f"'{param.param_path}': shard id must be one of {SHARD_IDS}, got {shard_id!r}")
        if not isinstance(expert_id, int) or not 0 <= expert_id < self.num_experts:
            raise WeightLoadError(f"'{param.param_path}': expert id {expert_id!r} outside [0, {self.num_experts})")
        where = f"{param.param_path}[expert {expert_id}, {shard_id}]"
        n, lo = self.inter_per_rank, self.tp_rank * self.inter_per_rank
        if self.quant_method is not None:
            loaded_weight = self.quant_method.source(loaded_weight, where)
        if shard_id == "down":
            if param is not self.down_proj_weight:
                raise WeightLoadError(f"'{param.param_path}' got shard id 'down' (it belongs to down_proj_weight)")
            check_shape(where, shape_of(loaded_weight), (self.hidden_size, self.intermediate_size))
            self._place(param, loaded_weight[:, lo:lo + n], expert_id, 0, shard_id)
        else:
            if param is not self.up_gate_proj_weight:
                raise WeightLoadError(f"'{param.param_path}' got shard id {shard_id!r} (it belongs to up_gate_proj_weight)")
            check_shape(where, shape_of(loaded_weight), (self.intermediate_size, self.hidden_size))
            offset = 0 if shard_id == "gate" else n
            self._place(param, loaded_weight[lo:lo + n], expert_id, offset, shard_id)
        mark_loaded(param, f"{expert_id}.{shard_id}")
        self._packed = None

    def checkpoint_param(self, name: str, part: str):
        """The parameter taking tensor ``part`` of one expert's checkpoint matrix for stacked weight ``name``:
        ``weight`` (float, or FP8 codes) or a GPTQ/FP8 component (``qweight``, ``scales``, ``weight_scale_inv``, ...).
        Its ``weight_loader(param, w, shard_id, expert_id)`` takes the tensor."""
        if self.quant_method is not None:
            return getattr(self, self.quant_method.param_name(name, part))
        if part != "weight":
            raise WeightLoadError(f"'{self.prefix}': an expert tensor '{part}' needs a pre-quantized checkpoint "
                                  "(config.json quantization_config) and experts not listed in modules_to_not_convert")
        return getattr(self, name)

    def _place(self, param, rows, expert_id: int, out_offset: int, shard_id: str) -> None:
        """Torch-layout ``rows`` ``[out, in]`` → output columns ``[out_offset, out_offset + out)`` of expert ``expert_id``."""
        if self.quant_method is not None:
            self.quant_method.place_expert(self, param, rows, expert_id, out_offset, shard_id)
            return
        n = shape_of(rows)[0]
        assign(param, as_float32(rows).T, (expert_id, slice(None), slice(out_offset, out_offset + n)))

    def _expert_weight(self, name: str, expert_id: int) -> paddle.Tensor:
        if self.quant_method is not None:
            return self.quant_method.expert_weight(self, name, expert_id)
        return getattr(self, name)[expert_id]

    def forward(self, x: paddle.Tensor, gate: nn.Layer) -> paddle.Tensor:
        """``x`` ``[T, hidden]``; ``gate`` maps fp32 ``[T, hidden]`` to router logits ``[T, E]``."""
        # The routing is tiny ([T, E]): it runs on the host, and so does the dispatch bookkeeping.
        top_i, top_w = route(gate(x.astype("float32")).astype("float32").numpy(), self.top_k, self.renormalize)
        host_x = _host(x.contiguous()) if self._packed is not None and x.dtype == paddle.float32 else None
        if host_x is not None:
            out = dlpack.from_dlpack(self._forward_packed(host_x, top_i, top_w))
        else:
            out = self._forward_paddle(x, top_i, top_w)
        if self.reduce_results:
            out = tensor_model_parallel_all_reduce(out, self.fd_config)
        return out

    def _forward_paddle(self, x: paddle.Tensor, top_i: np.ndarray, top_w: np.ndarray) -> paddle.Tensor:
        t, k, num_experts = x.shape[0], self.top_k, self.num_experts
        flat = top_i.reshape(-1)
        counts = np.bincount(flat, minlength=num_experts)
        cap = int(counts.max())
        # Pair p = (token p // k, expert flat[p]) takes row dest[p] of its expert's segment. A small batch
        # that reaches every expert is bound by reading the expert weights: it pads every segment to the
        # busiest expert's count and runs each projection as one batched matmul over the stacked weights.
        # Otherwise segments are exact and each expert with rows gets its own matmul: a large batch is
        # compute-bound (padding would be wasted work), and a batch that skips experts must not read them.
        # Packed experts (:meth:`_forward_packed`) always take exact segments.
        batched = (self.quant_method is None and bool(np.all(counts))
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
        act = _swiglu_scaled(self._project("up_gate_proj_weight", rows, segments), row_weights)
        y = self._project("down_proj_weight", act, segments)
        return _sum_rows(y.astype("float32"), dest.reshape(t, k)).astype(x.dtype)

    def _forward_packed(self, x: np.ndarray, top_i: np.ndarray, top_w: np.ndarray) -> np.ndarray:
        """The dispatch in NumPy against the packed experts, in exact segments (padding paid for fewer calls;
        a call against a packed weight costs no repacking): pairs sorted by expert (stable) are the rows of
        one buffer, every expert's product is written into its rows, and the inverse permutation sums each
        token's pairs."""
        up_gate, down = self._packed
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

    def _project(self, name: str, rows: paddle.Tensor, segments) -> paddle.Tensor:
        """Every expert's rows times its weight. ``segments`` None: ``rows`` are ``E`` equal padded segments
        (one batched matmul); else ``(starts, counts)`` of exact segments, one matmul per expert that has
        rows (quantized experts are dequantized one at a time)."""
        if segments is None:
            weight = getattr(self, name)
            return paddle.bmm(rows.reshape([self.num_experts, -1, rows.shape[1]]), weight).reshape([rows.shape[0], -1])
        return paddle.concat([paddle.matmul(rows[s:s + n], self._expert_weight(name, e))
                              for e, (s, n) in enumerate(zip(*segments)) if n], axis=0)


# Padding rows a batched expert matmul may add (see FusedMoE.forward).
_MAX_PAD_ROWS = 256


def route(logits: np.ndarray, top_k: int, renormalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """fp32 softmax over the experts, top-k (ties to the lower expert id), optionally renormalised:
    ``(expert ids [T, k], weights [T, k])``."""
    probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    top_i = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]
    top_w = np.take_along_axis(probs, top_i, axis=-1)
    if renormalize:
        top_w /= top_w.sum(axis=-1, keepdims=True)
    return top_i, top_w


def _host(t: paddle.Tensor) -> np.ndarray | None:
    """A NumPy view of a CPU tensor's memory (None on other devices)."""
    return np.from_dlpack(t) if t.place.is_cpu_place() else None


def _gather_rows(x: paddle.Tensor, src: np.ndarray, dest: np.ndarray, num_rows: int) -> paddle.Tensor:
    """``[num_rows, hidden]`` with row ``dest[i]`` = ``x[src[i]]``; any other (padding) row is a copy of
    ``x[0]``: its routing weight is 0 and nothing reads its output. On CPU in NumPy (Paddle's CPU gather is
    several times slower than a memcpy)."""
    index = np.zeros(num_rows, np.int64)
    index[dest] = src
    host = _host(x.contiguous())
    if host is not None:
        return dlpack.from_dlpack(np.take(host, index, axis=0))
    return paddle.gather(x, paddle.to_tensor(index))


def _swiglu_scaled(h: paddle.Tensor, scale: np.ndarray) -> paddle.Tensor:
    """``silu(h[:, :I]) * h[:, I:] * scale[:, None]`` (gate columns first): each pair's routing weight is
    applied to its activation, so combining pairs is a plain sum. NumPy on CPU, where Paddle's swiglu runs
    at half the speed, split by rows over the host threads (a 4096-row prefill: 16 -> 9-12 ms per layer)."""
    host = _host(h)
    if host is None:
        return nn.functional.swiglu(h) * paddle.to_tensor(scale).unsqueeze(1)
    return dlpack.from_dlpack(_swiglu_scaled_host(host, scale))


def _swiglu_scaled_host(host: np.ndarray, scale: np.ndarray) -> np.ndarray:
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


def _sum_rows(y: paddle.Tensor, dest: np.ndarray) -> paddle.Tensor:
    """``out[t] = sum_j y[dest[t, j]]`` → ``[T, hidden]``."""
    host = _host(y)
    if host is None:
        return paddle.gather(y, paddle.to_tensor(dest.reshape(-1))).reshape([dest.shape[0], dest.shape[1], -1]).sum(1)
    return dlpack.from_dlpack(_sum_rows_host(host, dest))


def _sum_rows_host(y: np.ndarray, dest: np.ndarray) -> np.ndarray:
    out = np.empty((dest.shape[0], y.shape[1]), y.dtype)

    def rows(c):
        np.take(y, dest[c, 0], axis=0, out=out[c])
        for j in range(1, dest.shape[1]):
            out[c] += y[dest[c, j]]

    run_chunked(rows, dest.shape[0], y.shape[1])
    return out
