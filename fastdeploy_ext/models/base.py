"""Model base class (FastDeploy's ``ModelForCasualLM`` surface, spelled correctly) and the shared
table-driven weight-loading loop."""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import Iterable

from paddle import nn

from fastdeploy_ext.layers.utils import WeightLoadError, default_weight_loader
from fastdeploy_ext.model_loader import check_all_loaded


@dataclass(frozen=True)
class KVCacheSpec:
    num_kv_heads: int  # per rank
    head_dim: int


@dataclass(frozen=True)
class StateCacheSpec:
    """A recurrent state per sequence: ``num_layers`` tensors of ``shape`` each (fp32)."""

    num_layers: int
    shape: tuple
    dtype: str = "float32"


class ModelForCausalLM(nn.Layer):
    config_class = None

    def __init__(self, fd_config):
        super().__init__()
        self.fd_config = fd_config

    @classmethod
    @abstractmethod
    def name(cls) -> str:
        """Equal to config.json's ``architectures[0]``."""

    @abstractmethod
    def forward(self, ids_remove_padding, forward_meta):
        """``[T]`` ids → ``[T, hidden]``."""

    @abstractmethod
    def compute_logits(self, hidden):
        """``[N, hidden]`` → fp32 ``[N, vocab]``."""

    @abstractmethod
    def kv_cache_spec(self) -> list[KVCacheSpec]:
        """One entry per softmax-attention layer, in ``kv_cache_index`` order."""

    def state_cache_spec(self) -> StateCacheSpec | None:
        return None

    def prefix_cache_spans(self, multimodal_inputs) -> list:
        """``(first position, end position, content digest)`` of every non-text input in the prompt, ascending:
        prefix-cache keys of blocks with such tokens include the digest (token ids alone do not tell two
        clips apart). Text-only models have none."""
        return []

    supports_prefix_caching = True
    # forward honours ForwardMeta.output_rows: it returns only those rows' hidden states (and may skip
    # the last layer's work for the others).
    selects_output_rows = False


def load_weights_by_table(model: nn.Layer, weights: Iterable, stacked_params_mapping: list,
                          ignore: tuple = (), skipped_params: tuple = ()) -> set:
    """Route every checkpoint tensor to one parameter's ``weight_loader``.

    ``stacked_params_mapping``: ``(param_part, ckpt_part, shard_id)``; the first row whose
    ``ckpt_part`` is a dotted component run of the name rewrites it. A tensor that matches no
    parameter raises (unless its name ends with an entry of ``ignore``); so does any parameter left
    (partly) unfilled. Returns the set of loaded checkpoint names.
    """
    params = dict(model.named_parameters())
    loaded = set()
    for ckpt_name, tensor in weights:
        if any(ckpt_name.endswith(s) for s in ignore):
            continue
        name, shard_id = ckpt_name, None
        for param_part, ckpt_part, sid in stacked_params_mapping:
            probe = f".{ckpt_part}."
            if probe in f".{ckpt_name}":
                name = f".{ckpt_name}".replace(probe, f".{param_part}.", 1)[1:]
                shard_id = sid
                break
        param = params.get(name)
        if param is None:
            raise WeightLoadError(f"checkpoint tensor '{ckpt_name}' matches no model parameter (looked for '{name}')")
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            loader(param, tensor, shard_id)
        except WeightLoadError as e:
            raise WeightLoadError(f"{e} [checkpoint tensor '{ckpt_name}']") from None
        loaded.add(ckpt_name)
    check_all_loaded(model, skipped_params)
    return loaded
