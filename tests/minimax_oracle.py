"""The MiniMax oracle (``fastdeploy_ext.models.minimax_m1.align``) and the per-layer statistics
(``fastdeploy_ext.entrypoints.align``) live in the package, shared with ``fastdeploy-ext align``; this module
re-exports them for the tests and benchmarks that import them here."""

from fastdeploy_ext.entrypoints.align import (  # noqa: F401
    engine_hidden_states,
    format_statistics,
    layer_statistics,
    oracle_hidden_states,
    oracle_logprobs,
)
from fastdeploy_ext.models.minimax_m1.align import hf_minimax_config, load_minimax_oracle  # noqa: F401
