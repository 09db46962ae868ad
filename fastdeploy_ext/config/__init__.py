from fastdeploy_ext.config.base import (
    CacheConfig,
    ConfigError,
    FDConfig,
    LoadConfig,
    ParallelConfig,
    QuantConfig,
    SchedulerConfig,
    load_hf_config,
)

__all__ = [
    "CacheConfig",
    "ConfigError",
    "FDConfig",
    "LoadConfig",
    "ParallelConfig",
    "QuantConfig",
    "SchedulerConfig",
    "load_hf_config",
]
