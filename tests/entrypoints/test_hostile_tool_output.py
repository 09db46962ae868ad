"""Hostile tool-call output through the real server: ``tool_choice: "required"`` lets only call JSON through
and ``logit_bias`` makes the tiny model nest arrays as deep as ``max_tokens`` allows (the shape that once
raised RecursionError out of the parser). Non-streaming answers 200, never 500; a stream ends with a final
chunk holding ``finish_reason`` and then ``[DONE]``."""

import json

import httpx
import pytest

# "a" may hold any JSON value: the biased "[" opens array after array inside it
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"a": {}}, "required": ["a"], "additionalProperties": False}}}]
OPEN_BRACKET = 58  # "[" in the tiny Qwen2 tokenizer (checked below)


@pytest.fixture(scope="module")
def server(start_server, tiny_qwen2_dir):
    from tokenizers import Tokenizer

    assert Tokenizer.from_file(f"{tiny_qwen2_dir}/tokenizer.json").encode("[", add_special_tokens=False).ids == [
        OPEN_BRACKET]
    return start_server(["--model", tiny_qwen2_dir, "--served-model-name", "qwen", "--max-model-len", "2048"])


def body(**extra):
    return {"model": "qwen", "messages": [{"role": "user", "content": "call f"}], "tools": TOOLS,
            "tool_choice": "required", "logit_bias": {str(OPEN_BRACKET): 100}, "max_tokens": 1200,
            "temperature": 0, **extra}


def test_deep_arguments_non_streaming_is_a_200(server):
    r = httpx.post(server.url + "/v1/chat/completions", json=body(), timeout=300)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    # cut off inside its only call: the block is content, and no call with arguments that are not JSON
    assert choice["message"].get("tool_calls") in (None, [])
    assert choice["message"]["content"].count("[") > 1000


def test_deep_arguments_stream_ends_with_a_final_chunk_and_done(server):
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body(stream=True), timeout=300) as r:
        assert r.status_code == 200
        data = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert all("error" not in c for c in chunks), chunks[-1]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert not any(c["choices"][0]["delta"].get("tool_calls") for c in chunks)
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert content.count("[") > 1000
