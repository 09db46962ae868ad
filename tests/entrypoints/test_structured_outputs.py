"""Structured outputs and tool calling through the real server (subprocess) with the official ``openai``
client, on the tiny Qwen2 and the tiny MiniMax-M1 (its own chat template). Random weights at temperature 1:
only the grammar makes the outputs valid, and ``jsonschema`` / ``re`` / pydantic check them.

The 20-seed servers run without a reasoning parser: with one, a grammar admits an optional ``<think>``
section first, and a random model that opens it (the tiny M1 does for 7 of 20 seeds) never closes it. The
reasoning server below serves a template that opens ``<think>`` itself."""

import asyncio
import os
import json
import re
from enum import Enum
from typing import Annotated

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

SEEDS = range(20)


@pytest.fixture(scope="module")
def servers(start_server, tiny_qwen2_dir, tmp_path_factory):
    from fastdeploy_ext.tiny import write_tiny

    m1_dir = str(tmp_path_factory.mktemp("tiny_m1_tools"))
    # prompts with two tools' schemas run to ~900 tiny-vocabulary tokens
    write_tiny("MiniMaxM1ForCausalLM", m1_dir, seed=0, max_position_embeddings=4096)
    qwen = start_server(["--model", tiny_qwen2_dir, "--served-model-name", "qwen", "--max-model-len", "2048"])
    m1 = start_server(["--model", m1_dir, "--served-model-name", "m1", "--max-model-len", "2048",
                       "--reasoning-parser", "none"])
    return {"qwen": (qwen, tiny_qwen2_dir), "m1": (m1, m1_dir)}


def client_of(servers, name):
    server, _ = servers[name]
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def concurrently(servers, name, method: str, requests: list[dict]):
    """``client.chat.completions.<method>(**kw)`` for every ``kw`` at once (one batch on the server)."""
    server, _ = servers[name]

    async def run():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                                      timeout=120) as aclient:
            return await asyncio.gather(*[getattr(aclient.chat.completions, method)(**kw) for kw in requests])
    return asyncio.run(run())


class Priority(str, Enum):
    low = "low"
    high = "high"


class Address(BaseModel):
    street: str = Field(max_length=12)
    zip: str = Field(pattern=r"^[0-9]{5}$")


class Ticket(BaseModel):
    title: str = Field(max_length=16)
    priority: Priority
    tags: list[Annotated[str, Field(max_length=6)]] = Field(max_length=3)
    address: Address
    assignee: str | None = Field(default=None, max_length=8)
    count: int = Field(ge=0, le=99)


MESSAGES = [{"role": "user", "content": "open a ticket"}]


@pytest.mark.parametrize("model", ["qwen", "m1"])
def test_parse_pydantic_model_20_seeds(servers, model):
    outs = concurrently(servers, model, "parse", [dict(model=model, messages=MESSAGES, response_format=Ticket,
                                                       temperature=1, max_tokens=512, seed=s) for s in SEEDS])
    for out in outs:
        choice = out.choices[0]
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Ticket)
        assert Ticket.model_validate_json(choice.message.content) == choice.message.parsed


@pytest.mark.parametrize("model", ["qwen", "m1"])
def test_parse_streaming_and_n3(servers, model):
    client = client_of(servers, model)
    with client.chat.completions.stream(model=model, messages=MESSAGES, response_format=Ticket, temperature=1,
                                        max_tokens=512, seed=3) as stream:
        deltas = [e.delta for e in stream if e.type == "content.delta"]
        final = stream.get_final_completion()
    assert len(deltas) > 3 and isinstance(final.choices[0].message.parsed, Ticket)
    assert "".join(deltas) == final.choices[0].message.content
    out = client.chat.completions.parse(model=model, messages=MESSAGES, response_format=Ticket, temperature=1,
                                        max_tokens=512, seed=4, n=3)
    assert len(out.choices) == 3 and all(isinstance(c.message.parsed, Ticket) for c in out.choices)
    assert len({c.message.content for c in out.choices}) > 1


REGEX = r"[A-Z]{2}-[0-9]{3}"
CHOICES = ["alpha", "beta", "gamma delta"]


@pytest.mark.parametrize("model", ["qwen", "m1"])
def test_json_object_regex_and_choice_20_seeds(servers, model):
    def calls(**kw):
        return concurrently(servers, model, "create", [dict(model=model, messages=MESSAGES, temperature=1,
                                                            max_tokens=512, seed=s, **kw) for s in SEEDS])

    objects = calls(response_format={"type": "json_object"})
    regexes = calls(extra_body={"guided_regex": REGEX})
    choices = calls(extra_body={"guided_choice": CHOICES})
    for o in objects:
        # Any object is an unbounded grammar: the random tiny M1 writes endless keys for 11 of the 20 seeds
        # (finish_reason "length", docs/deployment.md); what ends must be an object.
        reason = o.choices[0].finish_reason
        assert reason == "stop" or (model == "m1" and reason == "length")
        if reason == "stop":
            assert isinstance(json.loads(o.choices[0].message.content), dict)
    assert sum(o.choices[0].finish_reason == "stop" for o in objects) >= (20 if model == "qwen" else 5)
    for o in regexes:
        assert o.choices[0].finish_reason == "stop" and re.fullmatch(REGEX, o.choices[0].message.content)
    for o in choices:
        assert o.choices[0].finish_reason == "stop" and o.choices[0].message.content in CHOICES
    streamed = "".join(c.choices[0].delta.content or "" for c in servers_stream(servers, model, REGEX))
    assert re.fullmatch(REGEX, streamed)


def servers_stream(servers, model, regex):
    client = client_of(servers, model)
    return client.chat.completions.create(model=model, messages=MESSAGES, temperature=1, max_tokens=64, seed=9,
                                          stream=True, extra_body={"guided_regex": regex})


def test_completions_take_grammars_too(servers):
    client = client_of(servers, "qwen")
    out = client.completions.create(model="qwen", prompt="id:", max_tokens=32, temperature=1, seed=1,
                                    extra_body={"guided_regex": REGEX})
    assert re.fullmatch(REGEX, out.choices[0].text) and out.choices[0].finish_reason == "stop"


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "weather of a city", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["city", "unit"],
        "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]},
                       "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}},
    {"type": "function", "function": {"name": "book_table", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["guests", "names"],
        "properties": {"guests": {"type": "integer", "minimum": 1, "maximum": 12},
                       "names": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 8}}}}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.mark.parametrize("model", ["qwen", "m1"])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_tool_calls_validate_20_seeds(servers, model, choice):
    tool_choice = "required" if choice == "required" else {"type": "function", "function": {"name": "book_table"}}
    outs = concurrently(servers, model, "create", [dict(
        model=model, messages=[{"role": "user", "content": "help me"}], tools=TOOLS, tool_choice=tool_choice,
        temperature=1, max_tokens=512, seed=s) for s in SEEDS])
    for out in outs:
        choice_ = out.choices[0]
        # `required` admits up to 8 calls and the random model often writes several: at 512 tokens a
        # response may be cut inside a later call; the complete calls before it are returned.
        assert choice_.finish_reason in (("tool_calls", "length") if choice == "required" else ("stop",))
        calls = choice_.message.tool_calls
        assert calls
        for call in calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        if choice == "named":
            assert [c.function.name for c in calls] == ["book_table"]


@pytest.mark.parametrize("model", ["qwen", "m1"])
def test_streamed_tool_calls_accumulate_to_the_non_streamed_ones(servers, model):
    client = client_of(servers, model)
    kw = dict(model=model, messages=[{"role": "user", "content": "help"}], tools=TOOLS, tool_choice="required",
              temperature=1, max_tokens=512, seed=7)
    full = client.chat.completions.create(**kw).choices[0]
    calls, reason = {}, None
    for chunk in client.chat.completions.create(**kw, stream=True):
        delta = chunk.choices[0].delta
        reason = chunk.choices[0].finish_reason or reason
        for d in delta.tool_calls or []:
            c = calls.setdefault(d.index, {"name": None, "arguments": ""})
            if d.function.name:
                c["name"] = d.function.name
            c["arguments"] += d.function.arguments or ""
    assert reason == full.finish_reason == "tool_calls"
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == \
        [(c.function.name, c.function.arguments) for c in full.message.tool_calls]


@pytest.mark.parametrize("model", ["qwen", "m1"])
def test_three_turn_conversation_matches_hf_chat_template(servers, model):
    import transformers

    from fastdeploy_ext.engine.chat_adapter import adapt_messages

    client = client_of(servers, model)
    _, model_dir = servers[model]
    messages = [{"role": "system", "content": "You book things."}, {"role": "user", "content": "weather in Oslo?"}]
    results = []
    for turn, choice in enumerate(["required", {"type": "function", "function": {"name": "book_table"}}]):
        out = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice=choice,
                                             temperature=1, max_tokens=512, seed=turn)
        msg = out.choices[0].message
        messages.append({"role": "assistant", "content": msg.content,
                         "tool_calls": [c.model_dump(exclude_none=True) for c in msg.tool_calls]})
        for k, call in enumerate(msg.tool_calls):
            results.append(f"result {turn}.{k} of {call.function.name}")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": results[-1]})
        messages.append({"role": "user", "content": f"thanks, turn {turn + 2}"})
    final = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=4, temperature=0,
                                           extra_body={"return_token_ids": True})
    server_ids = final.model_extra["prompt_token_ids"]

    hf = transformers.AutoTokenizer.from_pretrained(model_dir)
    adapted = adapt_messages([{k: v for k, v in m.items() if v is not None} for m in messages],
                             "minimax_m1" if model == "m1" else "hf")
    text = hf.apply_chat_template(adapted, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert hf.encode(text, add_special_tokens=False) == server_ids
    for m in messages:
        for call in m.get("tool_calls") or []:
            assert call["function"]["name"] in text
            assert json.dumps(json.loads(call["function"]["arguments"]), ensure_ascii=False) in text
    assert all(r in text for r in results)
    assert all(t["function"]["name"] in text for t in TOOLS)


def test_tool_choice_none_and_auto_return_text(servers):
    client = client_of(servers, "qwen")
    for choice in ("none", "auto"):
        out = client.chat.completions.create(model="qwen", messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                             temperature=0, max_tokens=8)
        assert out.choices[0].message.tool_calls is None and out.choices[0].message.content


OPENS_THINK = "{{ '<|im_start|>user\n' ~ messages[-1]['content'] ~ '<|im_end|>\n<|im_start|>assistant\n<think>\n' }}"


@pytest.fixture(scope="module")
def reasoning_client(start_server, tiny_qwen2_dir, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "opens_think.jinja"
    template.write_text(OPENS_THINK)
    server = start_server(["--model", tiny_qwen2_dir, "--served-model-name", "r", "--max-model-len", "256",
                           "--reasoning-parser", "think", "--chat-template", str(template)])
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_reasoning_content_streamed_and_not(reasoning_client):
    kw = dict(model="r", messages=MESSAGES, temperature=1, max_tokens=40, seed=2)
    full = reasoning_client.chat.completions.create(**kw).choices[0]
    # The template opened <think> and the random model never writes </think>: all of it is reasoning.
    reasoning = full.message.model_extra["reasoning_content"]
    assert reasoning and full.message.content is None and full.finish_reason == "length"
    chunks = list(reasoning_client.chat.completions.create(**kw, stream=True))
    streamed = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks if c.choices)
    assert streamed == reasoning
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_deployment_doc_examples(servers):
    """The structured-output examples of docs/deployment.md, against the tiny Qwen2 server."""
    path = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "deployment.md")
    with open(path, encoding="utf-8") as f:
        doc = f.read()
    section = doc.split("<!-- examples: tests/entrypoints/test_structured_outputs.py")[1].split("**Unbounded")[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 2
    server, _ = servers["qwen"]
    namespace = {}
    for code in blocks:
        exec(code.replace("http://127.0.0.1:8000", server.url).replace('"tiny-qwen2"', '"qwen"'), namespace)
    assert namespace["out"].choices[0].message.tool_calls
