"""Vocab-parallel embedding and LM head (logits in max(float32, compute dtype))."""

from __future__ import annotations

import numpy as np
import paddle
from paddle import nn

from fastdeploy_ext.config.base import divide
from fastdeploy_ext.distributed.communication import (
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
    tp_rank,
    tp_size,
)
from fastdeploy_ext.layers.backend import (
    accum_dtype,
    as_host_tensor,
    backend_of,
    compute_dtype,
    host_transposed,
    host_view,
    matmul_into,
)
from fastdeploy_ext.layers.utils import (
    WeightLoadError,
    as_float32,
    assign,
    check_shape,
    create_param,
    mark_loaded,
    shape_of,
)


class VocabParallelEmbedding(nn.Layer):
    """Rows ``[rank * V/tp, (rank+1) * V/tp)`` of the table on each rank; lookups outside the local
    range contribute zeros and the all-reduce assembles the full embedding.

    Parameter ``embeddings.weight``: ``[num_embeddings / tp, embedding_dim]``.
    """

    def __init__(self, fd_config, num_embeddings: int, embedding_dim: int, prefix: str = ""):
        super().__init__()
        self.fd_config = fd_config
        self.prefix = prefix
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.tp_size, self.tp_rank = tp_size(fd_config), tp_rank(fd_config)
        self.per_rank = divide(num_embeddings, self.tp_size, f"{prefix}: vocab_size / tensor_parallel_size")
        self.vocab_start = self.tp_rank * self.per_rank
        self.embeddings = nn.Layer()
        self.embeddings.weight = create_param(self.embeddings, [self.per_rank, embedding_dim],
                                              compute_dtype(fd_config), value=None)
        self.embeddings.weight.weight_loader = self.weight_loader
        self.embeddings.weight.param_path = f"{prefix}.embeddings.weight"
        # The host backend looks rows up and computes tied logits in NumPy (ops/host/gemm.py).
        self.host = backend_of(fd_config) == "host" and compute_dtype(fd_config) == "float32"
        if self.host and self.tp_size == 1:
            self.forward = self._forward_host

    def weight_loader(self, param, loaded_weight, shard_id=None):
        if shard_id is not None:
            raise WeightLoadError(f"'{param.param_path}' takes no shard id, got {shard_id!r}")
        check_shape(param.param_path, shape_of(loaded_weight), (self.num_embeddings, self.embedding_dim))
        assign(param, as_float32(loaded_weight[self.vocab_start:self.vocab_start + self.per_rank]))
        mark_loaded(param)

    def _forward_host(self, ids_remove_padding: paddle.Tensor) -> paddle.Tensor:
        return as_host_tensor(np.take(host_view(self.embeddings.weight), host_view(ids_remove_padding), axis=0))

    def host_head_weight(self, rows: int) -> np.ndarray:
        """The tied LM head's ``[H, V / tp]`` weight on the host for ``rows`` hidden states. One row reads the
        transposed view of the ``[V, H]`` table; from the first call with several rows on, a row-major copy of that
        transpose (made again only when the table's memory changes). For a 545 MB Qwen2-0.5B head MKL streamed the
        view at 7.3 GB/s for 8 rows in the engine against 14-15 GB/s for the copy (docs/benchmarks.md), and at 23
        against 26 GB/s for one row in a micro-benchmark. The copy costs a second ``V x H`` float32 table in host
        memory and ~0.25 s, paid by the first step of several sequences rather than at load."""
        key = self.embeddings.weight.data_ptr()
        cached = self.__dict__.get("_host_head")
        if cached is not None and cached[0] == key:
            return cached[1]
        table = host_view(self.embeddings.weight)
        if rows == 1:
            return table.T
        self.__dict__["_host_head"] = (key, host_transposed(table))
        return self.__dict__["_host_head"][1]

    def forward(self, ids_remove_padding: paddle.Tensor) -> paddle.Tensor:
        """``ids_remove_padding`` ``[T]`` int64 → ``[T, embedding_dim]``."""
        if self.tp_size == 1:
            return nn.functional.embedding(ids_remove_padding, self.embeddings.weight)
        local = ids_remove_padding - self.vocab_start
        in_range = (local >= 0) & (local < self.per_rank)
        out = nn.functional.embedding(paddle.where(in_range, local, paddle.zeros_like(local)), self.embeddings.weight)
        out = out * in_range.astype(out.dtype).unsqueeze(-1)
        return tensor_model_parallel_all_reduce(out, self.fd_config)


class ParallelLMHead(nn.Layer):
    """Vocab-parallel output projection; ``forward`` returns full logits ``[T, V]``.

    Parameter ``linear.weight``: ``[embedding_dim, num_embeddings / tp]`` in max(float32, compute dtype) (fp32
    under bf16: MiniMax and Qwen2 logits lose top-k order in bf16)."""

    def __init__(self, fd_config, embedding_dim: int, num_embeddings: int, prefix: str = "lm_head"):
        super().__init__()
        self.fd_config = fd_config
        self.prefix = prefix
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.tp_size, self.tp_rank = tp_size(fd_config), tp_rank(fd_config)
        self.per_rank = divide(num_embeddings, self.tp_size, f"{prefix}: vocab_size / tensor_parallel_size")
        self.linear = nn.Layer()
        self.linear.weight = create_param(self.linear, [embedding_dim, self.per_rank], accum_dtype(fd_config),
                                          value=None)
        self.linear.weight.weight_loader = self.weight_loader
        self.linear.weight.param_path = f"{prefix}.linear.weight"
        self.host = backend_of(fd_config) == "host" and accum_dtype(fd_config) == "float32"

    def weight_loader(self, param, loaded_weight, shard_id=None):
        if shard_id is not None:
            raise WeightLoadError(f"'{param.param_path}' takes no shard id, got {shard_id!r}")
        check_shape(param.param_path, shape_of(loaded_weight), (self.num_embeddings, self.embedding_dim))
        start = self.tp_rank * self.per_rank
        assign(param, as_float32(loaded_weight[start:start + self.per_rank]).T)
        mark_loaded(param)

    def forward(self, hidden: paddle.Tensor) -> paddle.Tensor:
        """``hidden`` ``[T, H]`` → logits ``[T, V]`` in the weight's dtype."""
        if self.host:
            logits = _host_logits(hidden, host_view(self.linear.weight))
        else:
            logits = paddle.matmul(hidden.astype(self.linear.weight.dtype), self.linear.weight)
        return tensor_model_parallel_all_gather(logits, self.fd_config, axis=-1)


def tied_lm_logits(embed_tokens: VocabParallelEmbedding, hidden: paddle.Tensor, fd_config) -> paddle.Tensor:
    """Logits ``[T, V]`` in max(float32, compute dtype) from the (vocab-parallel) input embedding, for tied
    ``lm_head`` configs."""
    dtype = accum_dtype(fd_config)
    if embed_tokens.host:
        logits = _host_logits(hidden, embed_tokens.host_head_weight(hidden.shape[0]))
    else:
        weight = embed_tokens.embeddings.weight.astype(dtype)
        logits = paddle.matmul(hidden.astype(dtype), weight, transpose_y=True)
    return tensor_model_parallel_all_gather(logits, fd_config, axis=-1)


def _host_logits(hidden: paddle.Tensor, weight) -> paddle.Tensor:
    """``hidden @ weight`` (``weight`` ``[H, V]``, a transposed view of a tied embedding included) in float32."""
    h = host_view(hidden.astype("float32"))
    out = np.empty((h.shape[0], weight.shape[1]), np.float32)
    return as_host_tensor(matmul_into(h, weight, out))
