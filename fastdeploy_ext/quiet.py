"""Paddle's start-up noise, silenced for the command line, the server and the tensor-parallel ranks.

Library users (``from fastdeploy_ext import LLM``) keep Paddle's own defaults; this module does not import
paddle, so it can act before Paddle's core library loads.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import sys
import warnings

# glog's INFO lines (tcp_store.cc, tcp_utils.cc, ...) every rank prints while connecting; warnings and
# errors still print. glog reads the variable when Paddle's core library loads, hence before `import paddle`.
_GLOG_LEVEL = "2"
_FLAGS_BANNER = re.compile(r"=+ Modified FLAGS detected =+\n(?:FLAGS\(.*\)\n)*=+\n")


def silence_paddle() -> None:
    """Call before paddle is imported. An explicit ``GLOG_minloglevel`` in the environment wins."""
    os.environ.setdefault("GLOG_minloglevel", _GLOG_LEVEL)
    # Paddle warns on import that ccache (a build cache for C++ extensions, which this package never builds)
    # is missing.
    warnings.filterwarnings("ignore", message="No ccache found", category=UserWarning)


@contextlib.contextmanager
def without_flags_banner():
    """``paddle.distributed.init_parallel_env`` writes every flag whose value differs from its default to
    stderr; on a stock install that is ``FLAGS_enable_pir_in_executor``, which Paddle sets itself. Everything
    else written to ``sys.stderr`` meanwhile is passed on."""
    real, captured = sys.stderr, io.StringIO()
    sys.stderr = captured
    try:
        yield
    finally:
        sys.stderr = real
        real.write(_FLAGS_BANNER.sub("", captured.getvalue()))
