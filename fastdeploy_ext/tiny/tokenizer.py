"""A tiny Qwen2-style byte-level BPE tokenizer, trained offline for tests and tiny checkpoints.

``write_tiny_tokenizer`` writes a ``tokenizer.json`` + ``tokenizer_config.json`` folder that both
``fastdeploy_ext.engine.tokenizer.Tokenizer`` and HF ``PreTrainedTokenizerFast`` load, so the tiny
models can run end to end without a model hub. The corpus is generated here from fixed word lists
(English, digits, Chinese, emoji) so that byte-level merges across multi-byte characters exist.
"""

import json
import os
import random

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

DEFAULT_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
AUDIO_SPECIAL_TOKENS = ("<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>")

# Qwen2's pre-tokenizer split pattern, so that the tiny tokenizer segments text like the real one.
_QWEN2_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_ENGLISH_WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one had "
    "by word but not what all were we when your can said there use an each which she do how their if will "
    "up other about out many then them these so some her would make like him into time has look two more "
    "write go see number no way could people my than first water been call who oil its now find long down "
    "day did get come made may part audio model token sound music speech listen hello world assistant user "
    "system question answer please thank helpful language reason think because value"
).split()
_CHINESE_PHRASES = (
    "你好", "世界", "我们", "音乐", "声音", "模型", "今天天气很好", "请问", "谢谢", "中文", "语言", "听一听",
)
_EMOJI = ("😀", "👍", "🎵", "🚀")
_PUNCTUATION = (".", ",", "!", "?", ":", ";")


def _corpus(seed: int, n_lines: int = 3000) -> list[str]:
    """Sentences mixing English words, numbers, Chinese, emoji, punctuation and whitespace runs."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        parts = []
        for _ in range(rng.randint(4, 12)):
            r = rng.random()
            if r < 0.70:
                word = rng.choice(_ENGLISH_WORDS)
                parts.append(word.capitalize() if rng.random() < 0.1 else word)
            elif r < 0.80:
                parts.append(str(rng.randint(0, 10**rng.randint(1, 5))))
            elif r < 0.92:
                parts.append(rng.choice(_CHINESE_PHRASES))
            else:
                parts.append(rng.choice(_EMOJI))
        sep = "  " if rng.random() < 0.05 else " "
        line = sep.join(parts) + rng.choice(_PUNCTUATION)
        if rng.random() < 0.1:
            line += "\n\n"
        lines.append(line)
    return lines


def _chat_template(has_audio: bool) -> str:
    """Qwen2's ChatML layout; audio parts render as the audio placeholder when the tokens exist."""
    audio_branch = (
        "{%- elif part['type'] in ['input_audio', 'audio_url', 'audio'] -%}"
        "{{ '<|audio_bos|><|AUDIO|><|audio_eos|>' }}"
        if has_audio
        else ""
    )
    return (
        "{%- macro render_content(content) -%}"
        "{%- if content is string -%}{{ content }}"
        "{%- else -%}{%- for part in content -%}"
        "{%- if part['type'] == 'text' -%}{{ part['text'] }}"
        + audio_branch
        + "{%- else -%}{{ raise_exception('Unsupported content part type: ' ~ part['type']) }}"
        "{%- endif -%}{%- endfor -%}{%- endif -%}"
        "{%- endmacro -%}"
        "{%- if messages[0]['role'] != 'system' -%}"
        "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
        "{%- endif -%}"
        "{%- for message in messages -%}"
        "{{ '<|im_start|>' ~ message['role'] ~ '\\n' ~ render_content(message['content']) ~ '<|im_end|>\\n' }}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
    )


def packaged_chat_template(name: str) -> str:
    """A chat template shipped in ``fastdeploy_ext/tiny/templates``: ``qwen2_tools`` (ours: ChatML with
    tool calls) or ``minimax_m1`` (MiniMax-M1's own template, from its tokenizer_config.json, Apache-2.0)."""
    with open(os.path.join(os.path.dirname(__file__), "templates", f"{name}.jinja"), encoding="utf-8") as f:
        return f.read()


def write_tiny_tokenizer(out_dir, vocab_size: int = 512, special_tokens=None, seed: int = 0,
                         chat_template: str | None = None) -> dict:
    """Train a byte-level BPE tokenizer offline and write it as an HF tokenizer folder.

    Args:
        out_dir: folder to write ``tokenizer.json`` and ``tokenizer_config.json`` into (created).
        vocab_size: target total vocabulary size including the special tokens; the real size is
            smaller only if the generated corpus runs out of pairs to merge.
        special_tokens: extra special tokens appended after ``<|endoftext|>``, ``<|im_start|>``,
            ``<|im_end|>`` (e.g. ``["<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>"]``).
        seed: seed of the generated corpus; the same seed gives byte-identical files.
        chat_template: template source; default: plain ChatML (with audio placeholders when the audio
            tokens are among the special tokens).

    Returns:
        dict with ``vocab_size`` (total, incl. special tokens), ``eos_token_id`` (``<|im_end|>``),
        ``pad_token_id`` (``<|endoftext|>``) and ``special_token_ids`` (token -> id for every
        special token), plus ``path``.
    """
    specials = list(DEFAULT_SPECIAL_TOKENS)
    for token in special_tokens or ():
        if token not in specials:
            specials.append(token)
    byte_alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(byte_alphabet) + len(specials):
        raise ValueError(
            f"vocab_size={vocab_size} is below the 256-byte alphabet plus {len(specials)} special tokens"
        )

    tokenizer = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(specials),
        min_frequency=2,
        show_progress=False,
        initial_alphabet=byte_alphabet,
    )
    tokenizer.train_from_iterator(_corpus(seed), trainer=trainer)
    # Added after training so the special ids sit at the end of the vocabulary, as in Qwen2.
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])

    special_ids = {t: tokenizer.token_to_id(t) for t in specials}
    has_audio = all(t in special_ids for t in AUDIO_SPECIAL_TOKENS)
    config = {
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(i): {
                "content": t,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for t, i in special_ids.items()
        },
        "additional_special_tokens": specials[1:],
        "bos_token": None,
        "chat_template": chat_template if chat_template is not None else _chat_template(has_audio),
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 32768,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }

    os.makedirs(out_dir, exist_ok=True)
    tokenizer.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, ensure_ascii=False, indent=2)
        f.write("\n")
    return {
        "path": str(out_dir),
        "vocab_size": tokenizer.get_vocab_size(with_added_tokens=True),
        "eos_token_id": special_ids["<|im_end|>"],
        "pad_token_id": special_ids["<|endoftext|>"],
        "special_token_ids": special_ids,
    }
