"""Engine tokenizer vs transformers' PreTrainedTokenizerFast on a tiny trained byte-level BPE folder."""

import json
import os
import random
import subprocess
import sys
import time

import jinja2
import pytest
import tokenizers
import transformers

from fastdeploy_ext.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from fastdeploy_ext.tiny.tokenizer import AUDIO_SPECIAL_TOKENS, write_tiny_tokenizer

TEXTS = {
    "ascii": "Hello world, the model said: 42 apples.",
    "chinese": "你好世界，今天天气很好。",
    "rare_cjk": "龍鳳呈祥",
    "emoji": "😀👍 🎵🚀🦀 ok",
    "whitespace": "a   b\n\n\tc  \r\n   \n",
    "specials_inside": "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>x<|AUDIO|>",
    "special_lookalike": "<|im_end |> <|im_start",
    "empty": "",
    "leading_space": " leading and trailing ",
}

CONVERSATIONS = {
    "user_only": [{"role": "user", "content": "hi there"}],
    "with_system": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "你好"},
        {"role": "assistant", "content": "ok 😀"},
        {"role": "user", "content": "again"},
    ],
    "content_parts": [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is in this clip?"},
                {"type": "audio_url", "audio_url": {"url": "clip.wav"}},
                {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}},
                {"type": "text", "text": " Thanks."},
            ],
        }
    ],
    "none_content": [
        {"role": "user", "content": "call the tool"},
        {"role": "assistant", "content": None, "name": None},
    ],
}


def _hf(path):
    return transformers.PreTrainedTokenizerFast.from_pretrained(str(path))


def _edit_config(path, **changes):
    config_file = os.path.join(path, "tokenizer_config.json")
    with open(config_file, encoding="utf-8") as f:
        config = json.load(f)
    config.update(changes)
    with open(config_file, "w", encoding="utf-8") as f:
        json.dump(config, f)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_tokenizer")
    info = write_tiny_tokenizer(path, special_tokens=list(AUDIO_SPECIAL_TOKENS))
    return path, info


@pytest.fixture(scope="module")
def ours(tiny):
    return Tokenizer.from_pretrained(tiny[0])


@pytest.fixture(scope="module")
def hf(tiny):
    return _hf(tiny[0])


def test_write_tiny_tokenizer_deterministic(tmp_path):
    info = write_tiny_tokenizer(tmp_path / "a", seed=3)
    write_tiny_tokenizer(tmp_path / "b", seed=3)
    write_tiny_tokenizer(tmp_path / "c", seed=4)
    # A fresh interpreter with another hash seed must reproduce the same bytes.
    script = "import sys; from fastdeploy_ext.tiny.tokenizer import write_tiny_tokenizer as w; w(sys.argv[1], seed=3)"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    subprocess.run([sys.executable, "-c", script, str(tmp_path / "d")], check=True, env=env)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        reference = (tmp_path / "a" / name).read_bytes()
        assert (tmp_path / "b" / name).read_bytes() == reference
        assert (tmp_path / "d" / name).read_bytes() == reference
    assert (tmp_path / "c" / "tokenizer.json").read_bytes() != (tmp_path / "a" / "tokenizer.json").read_bytes()

    tok = Tokenizer.from_pretrained(tmp_path / "a")
    assert info["vocab_size"] == tok.vocab_size == 512
    assert info["special_token_ids"] == {t: tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")}
    assert info["eos_token_id"] == tok.eos_token_id == tok.token_to_id("<|im_end|>")
    assert info["pad_token_id"] == tok.pad_token_id == tok.token_to_id("<|endoftext|>")


def test_special_tokens_match_hf(tiny, ours, hf):
    _, info = tiny
    assert ours.vocab_size == len(hf) == info["vocab_size"]
    assert ours.eos_token_id == hf.eos_token_id == info["special_token_ids"]["<|im_end|>"]
    assert ours.bos_token_id is None and hf.bos_token_id is None
    assert ours.pad_token_id == hf.pad_token_id
    assert ours.all_special_ids == hf.all_special_ids
    assert set(ours.all_special_ids) == set(info["special_token_ids"].values())
    assert ours.eos_token_ids == {ours.eos_token_id}
    assert [ours.id_to_token(i) for i in range(len(hf))] == hf.convert_ids_to_tokens(list(range(len(hf))))
    assert all(ours.token_to_id(ours.id_to_token(i)) == i for i in range(len(hf)))
    assert ours.token_to_id("not-a-token-at-all") is None


@pytest.mark.parametrize("text", list(TEXTS.values()), ids=list(TEXTS))
@pytest.mark.parametrize("add_special_tokens", [True, False], ids=["special", "plain"])
def test_encode_matches_hf(ours, hf, text, add_special_tokens):
    assert ours.encode(text, add_special_tokens=add_special_tokens) == hf.encode(
        text, add_special_tokens=add_special_tokens
    )


@pytest.mark.parametrize("skip_special_tokens", [True, False], ids=["skip", "keep"])
def test_decode_matches_hf(ours, hf, skip_special_tokens):
    sequences = [hf.encode(text) for text in TEXTS.values()]
    rng = random.Random(7)
    sequences += [[rng.randrange(len(hf)) for _ in range(rng.randint(1, 40))] for _ in range(50)]
    for ids in sequences:
        assert ours.decode(ids, skip_special_tokens=skip_special_tokens) == hf.decode(
            ids, skip_special_tokens=skip_special_tokens
        )
    assert ours.decode(hf.encode(TEXTS["specials_inside"]), skip_special_tokens=True) == "user\nhi\nx"


@pytest.mark.parametrize("conversation", list(CONVERSATIONS.values()), ids=list(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False], ids=["gen", "nogen"])
def test_chat_template_matches_hf(ours, hf, conversation, add_generation_prompt):
    text = ours.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
    assert text == hf.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tokenize=False)
    ids = ours.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tokenize=True)
    assert ids == hf.apply_chat_template(
        conversation, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
    )
    assert text.endswith("<|im_start|>assistant\n") == add_generation_prompt


def test_chat_template_layout(ours):
    parts = CONVERSATIONS["content_parts"]
    assert ours.apply_chat_template(parts) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is in this clip?<|audio_bos|><|AUDIO|><|audio_eos|>"
        "<|audio_bos|><|AUDIO|><|audio_eos|> Thanks.<|im_end|>\n<|im_start|>assistant\n"
    )


def test_chat_template_without_audio_tokens_raises_like_hf(tmp_path):
    write_tiny_tokenizer(tmp_path)
    ours, hf = Tokenizer.from_pretrained(tmp_path), _hf(tmp_path)
    assert ours.token_to_id("<|AUDIO|>") is None
    for tok in (ours, hf):
        with pytest.raises(jinja2.TemplateError, match="Unsupported content part type: audio_url"):
            tok.apply_chat_template(CONVERSATIONS["content_parts"], tokenize=False)


def test_chat_template_environment_matches_hf(ours, hf):
    # Indented block tags on their own lines: output is only clean with trim_blocks + lstrip_blocks.
    template = """{% set ns = namespace(n=0) %}
{% for m in messages %}
    {% if loop.index > 2 %}{% break %}{% endif %}
    {% set ns.n = ns.n + 1 %}
[{{ m['role'] }}] {{ m['content'] | tojson }}
{% endfor %}
{{ tools | tojson(indent=2) }}|{{ strftime_now('%Y') }}|{{ ns.n }}|{{ eos_token }}|{{ pad_token }}
{% if messages | length > 3 %}{{ raise_exception('too many messages') }}{% endif %}"""
    tools = [{"name": "f", "description": "x < y & \"quoted\" 中文"}]
    messages = CONVERSATIONS["with_system"][:3]
    expected = hf.apply_chat_template(messages, chat_template=template, tools=tools, tokenize=False)
    assert ours.apply_chat_template(messages, chat_template=template, tools=tools) == expected
    assert expected.startswith('[system] "Be brief."\n[user] "你好"\n[\n  {\n')
    assert '"x < y & \\"quoted\\" 中文"' in expected
    for tok in (ours, hf):
        with pytest.raises(jinja2.TemplateError, match="too many messages"):
            tok.apply_chat_template(CONVERSATIONS["with_system"], chat_template=template, tokenize=False)


def test_named_chat_templates_match_hf(tmp_path):
    named = tmp_path / "named"
    write_tiny_tokenizer(named)
    templates = [
        {"name": "default", "template": "D{% for m in messages %}{{ m['content'] }}{% endfor %}"},
        {"name": "tool_use", "template": "T{{ tools | length }}"},
        {"name": "terse", "template": "S{{ messages | length }}{{ add_generation_prompt }}"},
    ]
    _edit_config(named, chat_template=templates)
    ours, hf = Tokenizer.from_pretrained(named), _hf(named)
    messages = CONVERSATIONS["user_only"]
    for kwargs in ({}, {"chat_template": "terse"}, {"tools": [{"name": "f"}]}):
        got = ours.apply_chat_template(messages, **kwargs)
        assert got == hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
    assert ours.apply_chat_template(messages, chat_template="terse") == "S1True"

    # A chat_template.jinja file overrides the config's template, as in transformers.
    jinja_file = tmp_path / "jinja_file"
    write_tiny_tokenizer(jinja_file)
    (jinja_file / "chat_template.jinja").write_text("F{{ messages[0]['content'] }}", encoding="utf-8")
    ours, hf = Tokenizer.from_pretrained(jinja_file), _hf(jinja_file)
    assert ours.apply_chat_template(messages) == hf.apply_chat_template(messages, tokenize=False) == "Fhi there"


SCENARIOS = {
    "pad_not_in_vocab": {"pad_token": "<pad>"},
    "unk_in_base_vocab": {"unk_token": "the"},
    "added_token_not_in_tokenizer_json": {
        "added_tokens_decoder": {
            "512": {"content": "<think>", "lstrip": False, "normalized": False, "rstrip": False,
                    "single_word": False, "special": False},
        }
    },
    "model_specific_token": {"audio_token": "<|AUDIO|>"},
    "split_special_tokens": {"split_special_tokens": True},
    "eos_as_added_token_dict": {
        "eos_token": {"content": "<|im_end|>", "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": True, "__type": "AddedToken"},
    },
}


@pytest.mark.parametrize("changes", list(SCENARIOS.values()), ids=list(SCENARIOS))
def test_token_registration_matches_hf(tmp_path, changes):
    write_tiny_tokenizer(tmp_path, special_tokens=["<|AUDIO|>"])
    if "added_tokens_decoder" in changes:
        with open(tmp_path / "tokenizer_config.json", encoding="utf-8") as f:
            decoder = json.load(f)["added_tokens_decoder"]
        changes = {"added_tokens_decoder": {**decoder, **changes["added_tokens_decoder"]}}
    _edit_config(tmp_path, **changes)
    ours, hf = Tokenizer.from_pretrained(tmp_path), _hf(tmp_path)
    assert ours.vocab_size == len(hf)
    assert ours.all_special_ids == hf.all_special_ids
    assert (ours.eos_token_id, ours.pad_token_id) == (hf.eos_token_id, hf.pad_token_id)
    for text in [*TEXTS.values(), "<pad> the <think>x</think> theme"]:
        ids = hf.encode(text)
        assert ours.encode(text) == ids
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    template = "{{ audio_token | default('none') }}|{{ pad_token }}"
    messages = CONVERSATIONS["user_only"]
    assert ours.apply_chat_template(messages, chat_template=template) == hf.apply_chat_template(
        messages, chat_template=template, tokenize=False
    )


def _stream(tokenizer, prompt_ids, generated, skip_special_tokens):
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens)
    deltas = [detok.add(token_id) for token_id in generated]
    deltas.append(detok.flush())
    return deltas, detok.text


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("skip_special_tokens", [True, False], ids=["skip", "keep"])
def test_incremental_detokenizer_random(ours, seed, skip_special_tokens):
    rng = random.Random(seed)
    multibyte_ids = ours.encode(TEXTS["chinese"] + TEXTS["rare_cjk"] + TEXTS["emoji"])
    prompt_ids = ours.apply_chat_template(CONVERSATIONS["with_system"], tokenize=True)
    for _ in range(100):
        n = rng.randint(1, 48)
        if rng.random() < 0.5:
            generated = [rng.randrange(ours.vocab_size) for _ in range(n)]
        else:
            # Valid text cut at random token boundaries, mixed with special tokens.
            start = rng.randrange(len(multibyte_ids))
            generated = multibyte_ids[start:start + n]
            if rng.random() < 0.5:
                generated.insert(rng.randrange(len(generated) + 1), rng.choice(ours.all_special_ids))
        prompt = prompt_ids if rng.random() < 0.5 else []
        deltas, text = _stream(ours, prompt, generated, skip_special_tokens)
        full = ours.decode(generated, skip_special_tokens=skip_special_tokens)
        assert "".join(deltas) == text == full
        if "\ufffd" not in full:
            assert not any("\ufffd" in delta for delta in deltas)


def test_incremental_detokenizer_holds_split_characters(ours):
    text = TEXTS["rare_cjk"] + TEXTS["emoji"]
    ids = ours.encode(text)
    decoded_pieces = [ours.decode([i]) for i in ids]
    # The fixture must really split characters across tokens, or this test proves nothing.
    assert sum("\ufffd" in piece for piece in decoded_pieces) >= 4
    deltas, streamed = _stream(ours, ours.encode("prompt: "), ids, skip_special_tokens=True)
    assert streamed == text
    assert deltas[-1] == ""
    assert "" in deltas[:-1]
    assert not any("\ufffd" in delta for delta in deltas)
    assert "龍" in deltas and "🦀" in deltas


def test_incremental_detokenizer_keeps_metaspace_leading_space(tmp_path):
    # SentencePiece-style decoders drop the leading space of the first token they decode, so the
    # stream needs prompt context to render the space that separates it from the prompt.
    vocab = {"<unk>": 0, "\u2581hello": 1, "\u2581world": 2, "\u2581again": 3, "</s>": 4}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace()
    backend.decoder = tokenizers.decoders.Metaspace()
    backend.save(str(tmp_path / "tokenizer.json"))
    config = {"eos_token": "</s>", "unk_token": "<unk>", "tokenizer_class": "PreTrainedTokenizerFast"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    ours, hf = Tokenizer.from_pretrained(tmp_path), _hf(tmp_path)
    prompt, generated = hf.encode("hello"), hf.encode("world again</s>")
    assert generated == [2, 3, 4]
    deltas, text = _stream(ours, prompt, generated, skip_special_tokens=True)
    full = hf.decode(prompt + generated, skip_special_tokens=True)
    assert deltas == [" world", " again", "", ""]
    assert text == full[len(hf.decode(prompt)):] == " world again"


def test_incremental_detokenizer_window_stays_small(ours):
    detok = IncrementalDetokenizer(ours, ours.encode("x" * 50), skip_special_tokens=True)
    ids = ours.encode("hello world 你好 " * 200)
    for token_id in ids:
        detok.add(token_id)
        assert len(detok._ids) <= 8
    assert detok.text == ours.decode(ids)


def test_eos_ids_include_generation_config(tmp_path, tiny):
    _, info = tiny
    write_tiny_tokenizer(tmp_path, special_tokens=list(AUDIO_SPECIAL_TOKENS))
    special = info["special_token_ids"]
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [special["<|endoftext|>"], special["<|im_end|>"]]}), encoding="utf-8"
    )
    tok = Tokenizer.from_pretrained(tmp_path)
    assert tok.eos_token_id == special["<|im_end|>"]
    assert tok.eos_token_ids == {special["<|endoftext|>"], special["<|im_end|>"]}

    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}), encoding="utf-8")
    assert Tokenizer.from_pretrained(tmp_path).eos_token_ids == {7, special["<|im_end|>"]}

    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "7"}), encoding="utf-8")
    with pytest.raises(ValueError, match=r"generation_config\.json: 'eos_token_id'"):
        Tokenizer.from_pretrained(tmp_path)


def test_missing_or_corrupt_tokenizer_json(tmp_path):
    write_tiny_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"model": {"type": "BPE"', encoding="utf-8")
    with pytest.raises(ValueError, match=r"tokenizer\.json cannot be loaded"):
        Tokenizer.from_pretrained(tmp_path)
    os.remove(tmp_path / "tokenizer.json")
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json not found"):
        Tokenizer.from_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Tokenizer.from_pretrained(tmp_path / "nowhere")


def test_malformed_tokenizer_config(tmp_path):
    write_tiny_tokenizer(tmp_path)
    config_file = tmp_path / "tokenizer_config.json"
    good = config_file.read_text(encoding="utf-8")

    config_file.write_text(good[:-10], encoding="utf-8")
    with pytest.raises(ValueError, match=r"tokenizer_config\.json is not valid JSON"):
        Tokenizer.from_pretrained(tmp_path)

    for changes, key in (({"eos_token": 5}, "'eos_token'"), ({"chat_template": 3}, "'chat_template'"),
                         ({"added_tokens_decoder": {"x": "<a>"}}, "added_tokens_decoder")):
        config_file.write_text(good, encoding="utf-8")
        _edit_config(tmp_path, **changes)
        with pytest.raises(ValueError, match=rf"tokenizer_config\.json: .*{key}"):
            Tokenizer.from_pretrained(tmp_path)

    os.remove(config_file)
    with pytest.raises(FileNotFoundError, match=r"tokenizer_config\.json"):
        Tokenizer.from_pretrained(tmp_path)


def test_runtime_does_not_import_torch_or_transformers():
    script = (
        "import sys; import fastdeploy_ext.engine.tokenizer, fastdeploy_ext.tiny.tokenizer; "
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "[]"
