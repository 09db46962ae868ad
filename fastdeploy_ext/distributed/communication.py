"""Tensor-parallel collectives on ``paddle.distributed``; identity when tp == 1.

Plain collectives (not fleet's mp layers, which have no CPU kernels) so the same code runs over gloo on
CPU and NCCL on GPU.
"""

from __future__ import annotations

import paddle


def tp_size(fd_config) -> int:
    return 1 if fd_config is None else fd_config.parallel_config.tensor_parallel_size


def tp_rank(fd_config) -> int:
    return 0 if fd_config is None else fd_config.parallel_config.tensor_parallel_rank


def tensor_model_parallel_all_reduce(x: paddle.Tensor, fd_config) -> paddle.Tensor:
    if tp_size(fd_config) == 1:
        return x
    import paddle.distributed as dist

    dist.all_reduce(x, group=fd_config.parallel_config.tp_group)
    return x


def tensor_model_parallel_all_gather(x: paddle.Tensor, fd_config, axis: int = -1) -> paddle.Tensor:
    """Concatenate each rank's shard along ``axis`` (rank order)."""
    if tp_size(fd_config) == 1:
        return x
    import paddle.distributed as dist

    parts: list = []
    dist.all_gather(parts, x, group=fd_config.parallel_config.tp_group)
    return paddle.concat(parts, axis=axis)
