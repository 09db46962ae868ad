"""The one workaround the test oracles need (environment.md §6).

``dasheng`` 0.0.9 pulls torchaudio 2.11.1, a CUDA build whose compiled extensions cannot load next to
torch 2.13+cpu (``libc10_cuda.so`` missing). transformers imports torchaudio when it is installed, so the
failure surfaces in any HF oracle, not only in dasheng. Removing the unloadable extension libraries makes
torchaudio fall back to pure Python, after which transformers and dasheng both import. It edits the
installed package, so it runs only when those libraries really cannot load.
"""

import ctypes
import importlib.util
import pathlib

TORCHAUDIO_EXTENSIONS = ("_torchaudio", "libtorchaudio", "torchaudio_prefixctc")


def fix_torchaudio() -> bool:
    """Delete torchaudio's extension libraries if one of them cannot be loaded; True if it did."""
    spec = importlib.util.find_spec("torchaudio")
    if spec is None or spec.origin is None:
        return False
    lib_dir = pathlib.Path(spec.origin).parent / "lib"
    for stem in TORCHAUDIO_EXTENSIONS:
        for lib in lib_dir.glob(f"{stem}*.so"):
            try:
                ctypes.CDLL(str(lib))
            except OSError:
                for name in TORCHAUDIO_EXTENSIONS:
                    for other in lib_dir.glob(f"{name}*.so"):
                        other.unlink()
                return True
    return False
