"""The torchaudio workaround on a stand-in package with an unloadable extension: the import works through the
shadow copy and the installed package is byte-for-byte unchanged."""

import hashlib
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Loads its extension at import, as torchaudio's _extension package does, and fails the same way.
STAND_IN = """
import ctypes, pathlib
_lib = pathlib.Path(__file__).parent / "lib" / "_torchaudio.so"
if _lib.exists():
    ctypes.CDLL(str(_lib))
"""


def _tree(path):
    out = {}
    for d, _, files in os.walk(path):
        for f in files:
            p = os.path.join(d, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, path)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def _import(site, fix: bool):
    code = ("import sys; sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[2])\n"
            + ("from tests.torchaudio_fix import fix_torchaudio; assert fix_torchaudio()\n" if fix else "")
            + "import torchaudio; print(torchaudio.__file__)")
    env = {**os.environ, "PYTHONPATH": ""}
    return subprocess.run([sys.executable, "-c", code, ROOT, str(site)], capture_output=True, text=True, env=env,
                          timeout=60)


def test_shadow_copy_imports_and_site_packages_stay_untouched(tmp_path):
    site = tmp_path / "site-packages"
    lib = site / "torchaudio" / "lib"
    lib.mkdir(parents=True)
    (site / "torchaudio" / "__init__.py").write_text(STAND_IN)
    (site / "torchaudio" / "functional.py").write_text("X = 1\n")
    (lib / "__init__.py").write_text("")
    (lib / "_torchaudio.so").write_bytes(b"not an ELF file")
    before = _tree(site)

    broken = _import(site, fix=False)
    assert broken.returncode != 0 and "OSError" in broken.stderr
    fixed = _import(site, fix=True)
    assert fixed.returncode == 0, fixed.stderr
    assert "fdext_torchaudio_" in fixed.stdout and str(site) not in fixed.stdout
    assert _tree(site) == before
