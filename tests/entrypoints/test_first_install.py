"""The README's first command, `pip install -e ".[cpu]"`, is enough for `serve`: the server runs in a process
whose import hook refuses every top-level module that the distributions of that install do not provide
(resolved from importlib.metadata, recursively through their requirements), and answers the `openai` client.
A dependency the code needs but the main install lacks makes `serve` fail here."""

import json
import os
import pathlib
import subprocess
import sys
from importlib import metadata

import openai
import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(ROOT, "configs", "tiny-qwen2.yaml")

# Runs before anything imports fastdeploy_ext. A module may be imported only from a file that an allowed
# distribution installed (its RECORD: this covers what a package vendors, e.g. setuptools' jaraco), from this
# checkout's fastdeploy_ext, or from the standard library; the allowed files and directories come in a JSON file.
HOOK = """
import importlib.abc, importlib.machinery, json, os, site, sys, sysconfig
with open(os.environ["FDEXT_ALLOWED_MODULES"]) as f:
    _allowed = json.load(f)
FILES, DIRS = set(_allowed["files"]), tuple(_allowed["dirs"])
_paths = sysconfig.get_paths()
STDLIB = tuple(os.path.realpath(_paths[k]) + os.sep for k in ("stdlib", "platstdlib"))
SITE = tuple(os.path.realpath(p) + os.sep for p in {_paths["purelib"], _paths["platlib"], *site.getsitepackages()})


def _installed(origin):
    origin = os.path.realpath(origin)
    return origin in FILES or origin.startswith(DIRS) or origin.startswith(STDLIB) and not origin.startswith(SITE)


class FirstInstallOnly(importlib.abc.MetaPathFinder):
    busy = False

    def find_spec(self, name, path=None, target=None):
        if self.busy:
            return None
        self.busy = True
        try:
            spec = next((s for f in sys.meta_path if f is not self and hasattr(f, "find_spec")
                         for s in [f.find_spec(name, path, target)] if s is not None), None)
            if spec is None or spec.origin in (None, "built-in", "frozen") or _installed(spec.origin):
                return None  # not found, a namespace package (its modules are checked one by one), or allowed
            # In a fresh venv this file would not exist: look on, as the import would (setuptools appends its
            # vendored copies, such as more_itertools, to sys.path).
            for entry in sys.path if path is None else path:
                later = importlib.machinery.PathFinder.find_spec(name, [entry])
                if later is not None and later.origin is not None and _installed(later.origin):
                    return later
            raise ModuleNotFoundError(f"No module named {name!r} (not provided by the first install: "
                                      f"{spec.origin})", name=name)
        finally:
            self.busy = False


sys.meta_path.insert(0, FirstInstallOnly())
"""
RUN_CLI = HOOK + "from fastdeploy_ext.entrypoints.cli import main\nsys.exit(main(sys.argv[1:]))\n"


def _this_checkout(dist) -> bool:
    direct = dist.read_text("direct_url.json")
    if direct:
        return json.loads(direct).get("url") == pathlib.Path(ROOT).as_uri()
    return os.path.realpath(dist.locate_file("")) == os.path.realpath(ROOT)


# What `python -m venv` seeds before the first command runs (ensurepip): pip, and setuptools before Python 3.12
# (Paddle imports setuptools and requires it only from 3.12 on, where venvs stop seeding it).
VENV_SEED = ("pip", "setuptools") if sys.version_info < (3, 12) else ("pip",)


def first_install_distributions() -> set[str]:
    """Canonical names of the distributions a fresh venv holds after `pip install -e ".[cpu]"`: its seed, then
    fastdeploy_ext with the cpu extra and, recursively, every requirement whose marker holds."""
    root = metadata.distribution("fastdeploy_ext")
    assert _this_checkout(root), (f"the installed fastdeploy_ext metadata ({root.locate_file('')}) is not this "
                                  f"checkout's: run `pip install -e .` (or `python setup.py egg_info`) in {ROOT}")
    seen = set()
    todo = [("fastdeploy_ext", frozenset({"cpu"}))] + [(name, frozenset()) for name in VENV_SEED]
    while todo:
        name, extras = todo.pop()
        if (canonicalize_name(name), extras) in seen:
            continue
        seen.add((canonicalize_name(name), extras))
        for line in metadata.distribution(name).requires or []:
            req = Requirement(line)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in extras or {""}):
                todo.append((req.name, frozenset(req.extras)))
    return {name for name, _ in seen}


def _allowed_file(tmp_path, drop=()):
    """The files the first install put in place (``drop``: distributions to leave out), as the hook reads them."""
    files = set()
    for name in first_install_distributions() - {canonicalize_name(d) for d in drop}:
        dist = metadata.distribution(name)
        files.update(os.path.realpath(dist.locate_file(f)) for f in dist.files or [])
    path = tmp_path / "allowed.json"
    path.write_text(json.dumps({"files": sorted(files), "dirs": [os.path.join(ROOT, "fastdeploy_ext") + os.sep]}))
    return {**os.environ, "FDEXT_ALLOWED_MODULES": str(path)}


def test_the_first_install_holds_the_server_and_not_the_extras():
    dists = first_install_distributions()
    assert {"paddlepaddle", "fastapi", "uvicorn", "numpy", "tokenizers", "safetensors"} <= dists
    assert not dists & {"torch", "transformers", "openai", "pytest", "dasheng", "matplotlib"}


def test_serve_answers_the_openai_client_with_only_the_first_install(start_server, tmp_path, monkeypatch):
    monkeypatch.setenv("FDEXT_ALLOWED_MODULES", _allowed_file(tmp_path)["FDEXT_ALLOWED_MODULES"])
    # The demo config writes its tiny checkpoint on first use; here into tmp_path rather than the checkout.
    server = start_server(["--config", CONFIG, "--model", str(tmp_path / "qwen2")], launcher=["-c", RUN_CLI])
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    out = client.completions.create(model="tiny-qwen2", prompt="hello", max_tokens=4, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 4 and out.choices[0].finish_reason == "length"
    chat = client.chat.completions.create(model="tiny-qwen2", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=3)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens <= 3


@pytest.mark.timeout(180)  # its subprocess has its own 120 s bound
def test_the_hook_refuses_what_the_first_install_lacks(tmp_path):
    """The control: the same hook fails `serve` when fastapi is taken out, and refuses torch (installed here for
    the test extra, not by the first command)."""
    env = _allowed_file(tmp_path, drop={"fastapi"})
    r = subprocess.run(["timeout", "120", sys.executable, "-c", RUN_CLI, "serve", "--config", CONFIG, "--model",
                        str(tmp_path / "qwen2"), "--port", "0"], capture_output=True, text=True, env=env, timeout=130)
    assert r.returncode != 0 and "No module named 'fastapi' (not provided by the first install" in r.stderr
    r = subprocess.run([sys.executable, "-c", HOOK + "import torch"], capture_output=True, text=True, env=env,
                       timeout=60)
    assert r.returncode != 0 and "No module named 'torch'" in r.stderr
