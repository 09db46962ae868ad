"""Request fields of the real server: every field the installed ``openai`` client can send (read from its
TypedDicts) and every vLLM extra is implemented or a 400 naming it; scoring (echo, prompt logprobs) against
the offline engine; logprob keys and bytes; the bounds on new inputs; routes and max_tokens defaults."""

import json
import os
import shutil
import typing

import httpx
import openai
import pytest

from fastdeploy_ext import LLM, SamplingParams

MODEL = "tiny"
MAX_MODEL_LEN = 256

CHAT_IMPLEMENTED = {"messages", "model", "frequency_penalty", "logit_bias", "logprobs", "max_completion_tokens",
                    "max_tokens", "n", "presence_penalty", "response_format", "seed", "stop", "stream",
                    "stream_options", "temperature", "tool_choice", "tools", "top_logprobs", "top_p", "user",
                    "safety_identifier"}
COMPLETION_IMPLEMENTED = {"model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs",
                          "max_tokens", "n", "presence_penalty", "seed", "stop", "stream", "stream_options",
                          "temperature", "top_p", "user"}
# vLLM's documented extra parameters (docs: "Extra parameters" of the OpenAI-compatible server).
VLLM_IMPLEMENTED = {"top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
                    "include_stop_str_in_output", "skip_special_tokens", "prompt_logprobs", "guided_json",
                    "guided_regex", "guided_choice", "guided_grammar", "return_tokens_as_token_ids",
                    "return_token_ids", "structured_outputs"}
VLLM_CHAT_IMPLEMENTED = {"add_generation_prompt", "chat_template_kwargs"}
VLLM_UNSUPPORTED = ["use_beam_search", "length_penalty", "truncate_prompt_tokens", "allowed_token_ids", "bad_words",
                    "priority", "request_id", "logits_processors", "cache_salt", "kv_transfer_params", "vllm_xargs",
                    "guided_decoding_backend", "guided_whitespace_pattern",
                    "spaces_between_special_tokens", "prompt_embeds"]
VLLM_CHAT_UNSUPPORTED = ["echo", "continue_final_message", "add_special_tokens", "documents", "chat_template",
                         "mm_processor_kwargs"]
PROBE = {"probe": 1}  # not the no-op value of any field


@pytest.fixture(scope="module")
def server(start_server, tiny_qwen2_dir):
    return start_server(["--model", tiny_qwen2_dir, "--served-model-name", MODEL, "--max-model-len", str(MAX_MODEL_LEN)])


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline(tiny_qwen2_dir):
    return LLM(model=tiny_qwen2_dir, max_model_len=MAX_MODEL_LEN)


def openai_fields(module) -> set[str]:
    return set(typing.get_type_hints(module.CompletionCreateParamsBase)) | {"stream"}


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 2}


def post(server, route, body):
    return httpx.post(server.url + route, json=body, timeout=60)


def assert_400_naming(r, field):
    assert r.status_code == 400, (field, r.text)
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"], err


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_every_openai_field_is_implemented_or_400(server, kind):
    from openai.types import completion_create_params
    from openai.types.chat import completion_create_params as chat_params

    fields = openai_fields(chat_params if kind == "chat" else completion_create_params)
    implemented = CHAT_IMPLEMENTED if kind == "chat" else COMPLETION_IMPLEMENTED
    assert implemented <= fields  # the claims name real fields of this client version
    route, base = ("/v1/chat/completions", CHAT) if kind == "chat" else ("/v1/completions", COMPLETION)
    for field in sorted(fields - implemented):
        assert_400_naming(post(server, route, {**base, field: PROBE}), field)


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_every_vllm_extra_is_implemented_or_400(server, kind):
    route, base = ("/v1/chat/completions", CHAT) if kind == "chat" else ("/v1/completions", COMPLETION)
    for field in VLLM_UNSUPPORTED + (VLLM_CHAT_UNSUPPORTED if kind == "chat" else []):
        assert_400_naming(post(server, route, {**base, field: PROBE}), field)
    extras = {"top_k": 5, "min_p": 0.01, "repetition_penalty": 1.1, "min_tokens": 1, "ignore_eos": True,
              "stop_token_ids": [7], "include_stop_str_in_output": True, "skip_special_tokens": False,
              "prompt_logprobs": 1, "return_tokens_as_token_ids": True, "return_token_ids": True,
              "guided_choice": ["a b", "c"]}
    if kind == "chat":
        extras |= {"add_generation_prompt": True, "chat_template_kwargs": {}}
    assert set(extras) | {"guided_json", "guided_regex", "guided_grammar", "structured_outputs"} == \
        VLLM_IMPLEMENTED | (VLLM_CHAT_IMPLEMENTED if kind == "chat" else set())
    r = post(server, route, {**base, **extras})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("route,base", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)])
def test_unknown_fields_and_bad_values_are_400(server, route, base):
    assert_400_naming(post(server, route, {**base, "temprature": 0.5}), "temprature")
    if "messages" in base:
        r = post(server, route, {**base, "messages": [{"role": "user", "content": "x", "extra": 1}]})
        assert_400_naming(r, "messages.0.extra")
        assert_400_naming(post(server, route, {**base, "response_format": {"type": "nonsense"}}), "response_format")
        assert_400_naming(post(server, route, {**base, "functions": [{"name": "f"}]}), "functions")
    for noop in ({"store": False}, {"parallel_tool_calls": True}, {"service_tier": "auto"}, {"logit_bias": {}}):
        if "messages" in base or "logit_bias" in noop:
            assert post(server, route, {**base, **noop}).status_code == 200, noop


def big_tools(n, schema_size=10):
    return [{"type": "function", "function": {"name": f"f{i}", "parameters": {
        "type": "object", "description": "x" * schema_size}}} for i in range(n)]


BOUNDS = {
    "tools_count": ({"tools": big_tools(65)}, "tools"),
    "tool_schema_bytes": ({"tools": big_tools(1, 70000)}, "tools.0.function.parameters"),
    "json_schema_bytes": ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "description": "x" * 70000}}}}, "response_format"),
    "regex_length": ({"guided_regex": "a" * 5000}, "guided_regex"),
    "choice_entries": ({"guided_choice": [str(i) for i in range(257)]}, "guided_choice"),
    "grammar_bytes": ({"guided_grammar": 'start: "' + "a" * 70000 + '"'}, "guided_grammar"),
    "logit_bias_entries": ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
    "logit_bias_value": ({"logit_bias": {"5": 101}}, "logit_bias"),
    "logit_bias_id": ({"logit_bias": {"512": 1}}, "logit_bias"),
    "logit_bias_key": ({"logit_bias": {"x": 1}}, "logit_bias"),
    "named_tool_unknown": ({"tools": big_tools(1), "tool_choice": {"type": "function", "function": {"name": "g"}}},
                           "tool_choice"),
    "two_constraints": ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    "invalid_regex": ({"guided_regex": "[a-"}, "guided_regex"),
    "invalid_grammar": ({"guided_grammar": "start: nope"}, "guided_grammar"),
}


@pytest.mark.parametrize("name", list(BOUNDS))
def test_each_bound_is_a_400_naming_the_field(server, name):
    extra, field = BOUNDS[name]
    assert_400_naming(post(server, "/v1/chat/completions", {**CHAT, **extra}), field)


def test_echo_scores_the_prompt_like_the_engine(client, offline):
    ids = offline.tokenizer.encode("hello world, the music of the day", add_special_tokens=True)
    ref = offline.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=0, prompt_logprobs=1),
                           use_tqdm=False)[0]
    for max_tokens in (1, 0):
        out = client.completions.create(model=MODEL, prompt=ids, echo=True, max_tokens=max_tokens, logprobs=1,
                                        temperature=0)
        lp = out.choices[0].logprobs
        assert len(lp.tokens) == len(ids) + max_tokens
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        for pos in range(1, len(ids)):
            assert lp.token_logprobs[pos] == pytest.approx(ref.prompt_logprobs[pos][ids[pos]], abs=1e-5)
            # lm-eval's is_greedy: the token's logprob against the best of top_logprobs
            best = max(ref.prompt_logprobs[pos].values())
            assert max(lp.top_logprobs[pos].values()) == pytest.approx(best, abs=1e-5)
        assert out.choices[0].text.startswith(offline.tokenizer.decode(ids, skip_special_tokens=False))
        assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=0)


def test_prompt_logprobs_extra(client, offline):
    ids = offline.tokenizer.encode("listen to the sound", add_special_tokens=True)
    ref = offline.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=0, prompt_logprobs=2),
                           use_tqdm=False)[0]
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, extra_body={"prompt_logprobs": 2})
    got = out.choices[0].model_extra["prompt_logprobs"]
    assert got[0] is None and len(got) == len(ids)
    for pos in range(1, len(ids)):
        assert str(ids[pos]) in got[pos]
        for tid, entry in got[pos].items():
            assert entry["logprob"] == pytest.approx(ref.prompt_logprobs[pos][int(tid)], abs=1e-5)
        ranked = [e for e in got[pos].values() if e["rank"] is not None]
        assert sorted(e["rank"] for e in ranked) == [1, 2]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                          extra_body={"prompt_logprobs": 0, "return_token_ids": True})
    prompt_ids = chat.model_extra["prompt_token_ids"]
    assert [int(next(iter(d))) for d in chat.choices[0].model_extra["prompt_logprobs"][1:]] == prompt_ids[1:]


def test_top_logprobs_string_collisions_keep_the_larger_value(client):
    collisions = 0
    for prompt in ("hello world", "你好 世界 音乐", "the music 🎵 of the day"):
        kw = dict(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, logprobs=20)
        by_str = client.completions.create(**kw).choices[0].logprobs
        by_id = client.completions.create(**kw, extra_body={"return_tokens_as_token_ids": True}).choices[0].logprobs
        assert all(t.startswith("token_id:") for t in by_id.tokens)
        for strings, ids in zip(by_str.top_logprobs, by_id.top_logprobs):
            assert len(ids) == 20 and all(k.startswith("token_id:") for k in ids)
            best: dict[str, float] = {}
            for key, value in ids.items():
                s = client_decode(int(key.split(":")[1]))
                collisions += s in best
                best[s] = max(best.get(s, value), value)
            assert strings == pytest.approx(best, abs=0)
    assert collisions > 0  # the check saw at least one pair of ids decoding alike


_DECODER = {}


def client_decode(token_id):
    if not _DECODER:
        from fastdeploy_ext.engine.tokenizer import Tokenizer

        _DECODER["tok"] = Tokenizer.from_pretrained(os.environ["TINY_QWEN2_DIR"])
    return _DECODER["tok"].decode([token_id], skip_special_tokens=False)


@pytest.fixture(autouse=True, scope="module")
def _tiny_dir_env(tiny_qwen2_dir):
    os.environ["TINY_QWEN2_DIR"] = tiny_qwen2_dir


def test_chat_top_logprobs_one_entry_per_id_and_raw_bytes(client, tiny_qwen2_dir):
    import transformers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    hf = transformers.AutoTokenizer.from_pretrained(tiny_qwen2_dir)
    byte_of = {c: b for b, c in bytes_to_unicode().items()}

    def raw(token_id):
        return [byte_of[c] for c in hf.convert_ids_to_tokens(token_id)]

    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "你好 🎵"}], max_tokens=16,
                                         temperature=0, logprobs=True, top_logprobs=20,
                                         extra_body={"return_tokens_as_token_ids": True})
    partial = 0
    for item in out.choices[0].logprobs.content:
        ids = [int(t.token.split(":")[1]) for t in item.top_logprobs]
        assert len(ids) == len(set(ids)) == 20
        for t, tid in zip(item.top_logprobs, ids):
            assert t.bytes == raw(tid)
            try:
                bytes(t.bytes).decode("utf-8")
            except UnicodeDecodeError:
                partial += 1
    assert partial > 0  # some entries are pieces of a UTF-8 character: their bytes are not the text's


def test_models_route_and_openai_shaped_404_405(server):
    card = httpx.get(server.url + "/v1/models/" + MODEL).json()
    assert card["id"] == MODEL and card["object"] == "model"
    for path, method, status in (("/v1/models/gpt-4", "GET", 404), ("/v1/nothing", "GET", 404),
                                 ("/v1/completions", "GET", 405)):
        r = httpx.request(method, server.url + path)
        assert r.status_code == status
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]


def test_max_tokens_defaults(client, start_server, tiny_qwen2_dir, tmp_path):
    out = client.completions.create(model=MODEL, prompt="hi", temperature=0, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 16  # OpenAI's legacy default
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=0,
                                         extra_body={"ignore_eos": True})
    with open(os.path.join(tiny_qwen2_dir, "generation_config.json")) as f:
        assert out.usage.completion_tokens == json.load(f)["max_new_tokens"]
    plain = str(tmp_path / "no_max_new_tokens")
    shutil.copytree(tiny_qwen2_dir, plain)
    with open(os.path.join(plain, "generation_config.json"), "w") as f:
        json.dump({"do_sample": False}, f)
    other = start_server(["--model", plain, "--served-model-name", "plain", "--max-model-len", "64"])
    out = openai.OpenAI(base_url=other.url + "/v1", api_key="x", max_retries=0).chat.completions.create(
        model="plain", messages=[{"role": "user", "content": "hi"}], temperature=0, extra_body={"ignore_eos": True})
    assert out.usage.prompt_tokens + out.usage.completion_tokens == 64 and out.choices[0].finish_reason == "length"
