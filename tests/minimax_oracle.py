"""The MiniMax oracle and per-layer statistics live in the package (``fastdeploy_ext.entrypoints.align``, shared
with ``fastdeploy-ext align``); this module re-exports them for the tests and benchmarks that import them here."""

from fastdeploy_ext.entrypoints.align import (  # noqa: F401
    engine_hidden_states,
    format_statistics,
    hf_minimax_config,
    layer_statistics,
    load_minimax_oracle,
    oracle_hidden_states,
    oracle_logprobs,
)
