"""The one workaround the test oracles need, without touching the installed packages.

``dasheng`` 0.0.9 pulls torchaudio 2.11.1, a CUDA build whose compiled extensions cannot load next to
torch 2.13+cpu (``libc10_cuda.so`` missing). transformers imports torchaudio when it is installed, so the
failure surfaces in any HF oracle, not only in dasheng. Without those extension libraries torchaudio falls
back to pure Python, after which transformers and dasheng both import.

So when one of them cannot load, a copy of torchaudio's Python package without them is made in a temporary
directory, which goes first on ``sys.path`` (and on ``PYTHONPATH``, for the servers and ranks the tests start)
for this test run; site-packages stays as installed.
"""

import atexit
import ctypes
import importlib
import importlib.util
import os
import pathlib
import shutil
import sys
import tempfile

TORCHAUDIO_EXTENSIONS = ("_torchaudio", "libtorchaudio", "torchaudio_prefixctc")


def _is_extension(name: str) -> bool:
    return name.endswith(".so") and name.startswith(TORCHAUDIO_EXTENSIONS)


def _unloadable(lib_dir: pathlib.Path) -> list:
    bad = []
    for lib in sorted(lib_dir.glob("*.so")):
        if _is_extension(lib.name):
            try:
                ctypes.CDLL(str(lib))
            except OSError:
                bad.append(lib)
    return bad


def fix_torchaudio() -> str | None:
    """Shadow an installed torchaudio whose extension libraries cannot load; returns the directory put first on
    ``sys.path``, or None when there was nothing to do (no torchaudio, or one that loads)."""
    spec = importlib.util.find_spec("torchaudio")
    if spec is None or spec.origin is None:
        return None
    package = pathlib.Path(spec.origin).parent
    if not _unloadable(package / "lib"):
        return None
    root = tempfile.mkdtemp(prefix="fdext_torchaudio_")
    atexit.register(shutil.rmtree, root, ignore_errors=True)

    def skip(directory, names):
        return [n for n in names if pathlib.Path(directory).name == "lib" and _is_extension(n)] + ["__pycache__"]

    shutil.copytree(package, os.path.join(root, "torchaudio"), ignore=skip)
    sys.path.insert(0, root)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    importlib.invalidate_caches()
    return root
