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


class TensorRoutes:
    """Checkpoint name -> table entry, by full name or, for the components a pre-quantized checkpoint stores in
    place of ``weight`` (``qweight``, ``scales``, ``weight_scale_inv``, ...), by the module the name ends in."""

    def __init__(self, table: Iterable):
        self.by_name, self.by_module = {}, {}
        for t in table:
            self.by_name[t.name] = t
            self.by_module.setdefault(t.name.rpartition(".")[0], t)

    def route(self, ckpt_name: str):
        """``(table entry, parameter name)`` for ``ckpt_name``, or ``(None, None)`` if the table has no such tensor."""
        t = self.by_name.get(ckpt_name)
        if t is not None:
            return t, t.target
        module, _, part = ckpt_name.rpartition(".")
        t = self.by_module.get(module)
        if t is None or "." not in t.target:
            return None, None
        return t, f"{t.target.rpartition('.')[0]}.{part}"


def load_weights_by_table(model: nn.Layer, weights: Iterable, table: Iterable, ignore: tuple = (),
                          skipped_params: tuple = ()) -> set:
    """Route every checkpoint tensor through the model's checkpoint table (``model_loader.shapes.Tensor`` rows)
    to one parameter's ``weight_loader``, with the row's shard id. A tensor the table does not hold raises
    (unless its name ends with an entry of ``ignore``); so does any parameter left (partly) unfilled. Returns
    the set of loaded checkpoint names.
    """
    params = dict(model.named_parameters())
    routes = TensorRoutes(table)
    loaded = set()
    for ckpt_name, tensor in weights:
        if any(ckpt_name.endswith(s) for s in ignore):
            continue
        t, name = routes.route(ckpt_name)
        param = params.get(name) if t is not None else None
        if param is None:
            raise WeightLoadError(f"checkpoint tensor '{ckpt_name}' matches no model parameter"
                                  + (f" (looked for '{name}')" if t is not None else " (not in the checkpoint table)"))
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            loader(param, tensor, t.shard)
        except WeightLoadError as e:
            raise WeightLoadError(f"{e} [checkpoint tensor '{ckpt_name}']") from None
        loaded.add(ckpt_name)
    check_all_loaded(model, skipped_params)
    return loaded
