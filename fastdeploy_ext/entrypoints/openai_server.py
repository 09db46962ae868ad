"""The OpenAI-compatible server's public names; the code is in ``entrypoints/openai/`` (its ``__init__`` says which
module does what)."""

from fastdeploy_ext.entrypoints.openai.app import build_app, run_server, startup_summary
from fastdeploy_ext.entrypoints.openai.engine_loop import EngineLoop, EngineStats, Update, prometheus_text, stats_line
from fastdeploy_ext.entrypoints.openai.server import OpenAIServer

__all__ = ["EngineLoop", "EngineStats", "OpenAIServer", "Update", "build_app", "prometheus_text", "run_server",
           "startup_summary", "stats_line"]
