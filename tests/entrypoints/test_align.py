"""``fastdeploy-ext align`` on tiny checkpoints: clean models align everywhere, a checkpoint with one layer perturbed
on our side only (the reference loads the original via ``--reference``) is blamed on exactly that layer, ``--plot``
writes a PNG, and a missing ``align`` dependency is a clear message with exit status 2.

Tolerance: 1e-5 relative per row on a clean model (fp32 on both sides, ~10 ops per layer; measured <= 1e-6). The
perturbations scale one weight by 1.01, which moves that layer's output by ~1e-3 relative: far above the default
1e-4 threshold, while every earlier row stays at fp32 noise.
"""

import os
import re
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

from fastdeploy_ext.entrypoints.cli import main
from fastdeploy_ext.tiny import write_tiny

PROMPT = "The quick brown fox jumps over the lazy dog, twice."
ARCHS = ["Qwen2ForCausalLM", "MiniMaxM1ForCausalLM", "MiniMaxForCausalLM", "MiDashengLMModel"]
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """``arch -> checkpoint dir``, written once per module."""
    root = tmp_path_factory.mktemp("align")
    dirs = {}
    for arch in ARCHS:
        dirs[arch] = str(root / arch)
        write_tiny(arch, dirs[arch], seed=1)
    return dirs


@pytest.fixture(scope="module")
def wav(tmp_path_factory):
    """A 1.3 s 16 kHz chirp with noise: 32 patches (two 16-patch chunks of the tiny encoder), 6 audio tokens."""
    import soundfile

    t = np.arange(int(1.3 * 16000)) / 16000
    wave = 0.3 * np.sin(2 * np.pi * (300 + 400 * t) * t) + 0.02 * np.random.default_rng(0).standard_normal(t.size)
    path = str(tmp_path_factory.mktemp("audio") / "clip.wav")
    soundfile.write(path, wave.astype(np.float32), 16000)
    return path


def audio_args(arch, wav):
    if arch != "MiDashengLMModel":
        return []
    from tests.layers.test_dasheng_encoder import import_dasheng

    import_dasheng()  # applies the torchaudio workaround of this environment, or skips
    return ["--audio", wav]


def run_align(argv, capsys):
    """``(exit status, stdout, {row name: rel err})`` of ``fastdeploy-ext align`` run in-process."""
    rc = main(["align", *argv])
    out = capsys.readouterr().out
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and cells[0] not in ("layer",):
            rows[cells[0]] = float(cells[-1])
    return rc, out, rows


@pytest.mark.parametrize("arch", ARCHS)
def test_clean_model_has_no_diverging_layer(tiny, wav, arch, capsys):
    rc, out, rows = run_align(["--model", tiny[arch], "--prompt", PROMPT, *audio_args(arch, wav)], capsys)
    assert rc == 0, out
    assert "no diverging layer" in out
    # A Markdown table: every row has the header's 7 cells (the pipes of |diff| are escaped).
    table = [line for line in out.splitlines() if line.startswith("|")]
    assert {len(re.split(r"(?<!\\)\|", line.strip().strip("|"))) for line in table} == {7}
    num_layers = {"Qwen2ForCausalLM": 2, "MiDashengLMModel": 2}.get(arch, 8)
    assert list(rows) == ["embed", *map(str, range(num_layers)), "norm"]
    assert max(rows.values()) <= 1e-5, out
    if arch == "MiDashengLMModel":
        assert rows["embed"] > 0, "the audio rows come from two different encoders, so they cannot be bit-equal"


def perturbed(src, dst, tensor):
    """Copy of checkpoint ``src`` with ``tensor`` scaled by 1.01."""
    import shutil

    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    tensors[tensor] = tensors[tensor] * np.float32(1.01)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    return dst


PERTURBED = [
    ("Qwen2ForCausalLM", "model.layers.1.mlp.down_proj.weight", "1"),
    ("MiniMaxM1ForCausalLM", "model.layers.3.self_attn.o_proj.weight", "3"),  # full attention
    ("MiniMaxM1ForCausalLM", "model.layers.5.self_attn.out_proj.weight", "5"),  # lightning
    ("MiniMaxForCausalLM", "model.layers.6.mlp.experts.down_proj", "6"),
    ("MiDashengLMModel", "decoder.model.layers.1.self_attn.o_proj.weight", "1"),
    ("MiDashengLMModel", "audio_encoder.blocks.1.mlp.fc2.weight", "embed"),
]


@pytest.mark.parametrize("arch,tensor,layer", PERTURBED, ids=[f"{a}-{t}" for a, t, _ in PERTURBED])
def test_perturbed_layer_is_named_and_plotted(tiny, wav, tmp_path, arch, tensor, layer, capsys):
    ours = perturbed(tiny[arch], str(tmp_path / "perturbed"), tensor)
    png = str(tmp_path / "align.png")
    rc, out, rows = run_align(["--model", ours, "--reference", tiny[arch], "--prompt", PROMPT, "--plot", png,
                               *audio_args(arch, wav)], capsys)
    assert rc == 1, out
    assert f"first diverging layer: {layer} (" in out
    names = list(rows)
    assert all(rows[n] <= 1e-5 for n in names[: names.index(layer)]), out
    assert rows[layer] > 1e-4
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(png) > 10_000


def test_threshold_flag(tiny, capsys):
    """Below the fp32 noise floor every computed layer diverges: the first one is layer 0 (embed is a lookup)."""
    rc, out, rows = run_align(["--model", tiny["Qwen2ForCausalLM"], "--prompt", PROMPT, "--threshold", "1e-12"],
                              capsys)
    assert rc == 1 and rows["embed"] == 0.0
    assert "first diverging layer: 0 (decoder" in out and "> 1e-12" in out
    assert main(["align", "--model", tiny["Qwen2ForCausalLM"], "--prompt", PROMPT, "--threshold", "0"]) == 2


def test_audio_for_a_text_model_is_an_error(tiny, wav, capsys):
    assert main(["align", "--model", tiny["Qwen2ForCausalLM"], "--prompt", PROMPT, "--audio", wav]) == 2
    assert "takes no audio" in capsys.readouterr().err


@pytest.mark.parametrize("module,arch", [("torch", "Qwen2ForCausalLM"), ("transformers", "MiniMaxM1ForCausalLM"),
                                         ("dasheng", "MiDashengLMModel")])
@pytest.mark.timeout(180)  # its subprocess has its own 120 s bound
def test_missing_extra_is_a_clear_message(tiny, wav, tmp_path, module, arch):
    """A subprocess whose ``module`` import fails (a shadowing package that raises ImportError)."""
    shadow = tmp_path / "shadow" / module
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text(f'raise ImportError("No module named {module!r} (simulated)")\n')
    env = {**os.environ, "GLOG_minloglevel": "2",
           "PYTHONPATH": os.pathsep.join([str(tmp_path / "shadow"), REPO, os.environ.get("PYTHONPATH", "")])}
    argv = ["align", "--model", tiny[arch], "--prompt", PROMPT] + (["--audio", wav] if module == "dasheng" else [])
    proc = subprocess.run([sys.executable, "-m", "fastdeploy_ext.entrypoints.cli", *argv], env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2, proc.stderr
    assert 'pip install -e ".[align]"' in proc.stderr and module in proc.stderr
    assert "Traceback" not in proc.stderr
