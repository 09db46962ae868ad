"""Hostile checkpoint files (issue 33): each is refused at load, naming the file and key, bounded in time and
memory, and on the CLI as one ``error:`` line (no traceback)."""

import json
import os
import resource
import shutil
import subprocess
import sys

import pytest

from fastdeploy_ext.config.base import ConfigError
from fastdeploy_ext.engine.tokenizer import Tokenizer
from fastdeploy_ext.model_loader.shapes import config_tensor_shapes, implied_tensor_count
from fastdeploy_ext.tiny import write_tiny

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("q") / "model")
    write_tiny("Qwen2ForCausalLM", d, seed=0)
    return d


def variant(tiny, tmp_path, name, edit):
    d = str(tmp_path / name)
    shutil.copytree(tiny, d)
    edit(d)
    return d


def edit_json(file, **changes):
    def edit(d):
        path = os.path.join(d, file)
        data = json.load(open(path)) if os.path.exists(path) else {}
        data.update(changes)
        json.dump(data, open(path, "w"))
    return edit


def write(file, text):
    def edit(d):
        with open(os.path.join(d, file), "w") as f:
            f.write(text)
    return edit


def cli_generate(d, memory_bytes=4 << 30):
    """``generate`` in a subprocess under ``timeout`` and an address-space cap: (returncode, stderr lines)."""
    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))

    proc = subprocess.run(["timeout", "120", sys.executable, "-m", "fastdeploy_ext.entrypoints.cli", "generate",
                           "--model", d, "--prompt", "hi", "--max-tokens", "2", "--no-tqdm"], capture_output=True,
                          text=True, cwd=ROOT, preexec_fn=cap)
    lines = [ln for ln in proc.stderr.splitlines() if "Warning" not in ln and "warnings.warn" not in ln and ln.strip()]
    return proc.returncode, lines


CASES = {
    "chat_template_syntax": (write("chat_template.jinja", "{% for m in messages %}{{ m.content }"),
                             "chat_template.jinja: syntax error at line 1"),
    "max_new_tokens_negative": (edit_json("generation_config.json", max_new_tokens=-5),
                                "generation_config.json: 'max_new_tokens' must be a positive int"),
    "eos_huge": (edit_json("generation_config.json", eos_token_id=10**9),
                 "generation_config.json: 'eos_token_id' holds 1000000000"),
    "eos_negative": (edit_json("generation_config.json", eos_token_id=[3, -1]),
                     "generation_config.json: 'eos_token_id' holds -1"),
    "generation_config_malformed": (write("generation_config.json", '{"max_new_tokens": '),
                                    "generation_config.json is not valid JSON"),
    "tokenizer_json_malformed": (write("tokenizer.json", '{"model": [1, 2'),
                                 "tokenizer.json cannot be loaded"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_tokenizer_folder_refusals_at_load(tiny, tmp_path, name):
    edit, needle = CASES[name]
    d = variant(tiny, tmp_path, name, edit)
    with pytest.raises(ConfigError, match=needle.replace("*", r"\*").replace("(", r"\(")):
        Tokenizer.from_pretrained(d)


def test_tokenizer_config_template_syntax_error_is_refused_at_load(tiny, tmp_path):
    d = variant(tiny, tmp_path, "cfg_template", edit_json("tokenizer_config.json",
                                                          chat_template="{% if x %}never closed"))
    with pytest.raises(ConfigError, match=r"tokenizer_config.json: 'chat_template': syntax error at line 1"):
        Tokenizer.from_pretrained(d)


def test_layer_count_is_bounded_by_the_checkpoint_before_shapes_are_built():
    raw = {"architectures": ["Qwen2ForCausalLM"], "num_hidden_layers": 10_000_000, "hidden_size": 64,
           "intermediate_size": 128, "vocab_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2}
    assert implied_tensor_count(raw) == 60_000_000
    with pytest.raises(ValueError, match="implies at least 60,000,000 tensors"):
        config_tensor_shapes(raw, max_tensors=10_000)
    moe = {"architectures": ["MiniMaxM1ForCausalLM"], "num_hidden_layers": 2, "num_local_experts": 10_000_000}
    with pytest.raises(ValueError, match="tensors"):
        config_tensor_shapes(moe, max_tensors=10_000)


@pytest.mark.parametrize("name,edit,needle", [
    ("layers_10M", edit_json("config.json", num_hidden_layers=10_000_000), "implies at least 60,000,000 tensors"),
    ("vocab_2_31", edit_json("config.json", vocab_size=2**31), "a dimension of 2**31 or more"),
    ("intermediate_2_32", edit_json("config.json", intermediate_size=2**32), "a dimension of 2**31 or more"),
    ("config_100k_deep", write("config.json", '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}"), "nested too deeply"),
    ("tokenizer_json_malformed", write("tokenizer.json", "{"), "tokenizer.json cannot be loaded"),
    ("eos_negative", edit_json("generation_config.json", eos_token_id=-1), "'eos_token_id' holds -1"),
])
def test_cli_prints_one_error_line_naming_the_file(tiny, tmp_path, name, edit, needle):
    d = variant(tiny, tmp_path, name, edit)
    code, lines = cli_generate(d)
    assert code == 2, lines[-20:]
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], lines[-20:]
    file = {"tokenizer_json_malformed": "tokenizer.json", "eos_negative": "generation_config.json"}.get(name, d)
    assert file in lines[0]
