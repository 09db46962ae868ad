"""The input processor (engine/processor.py), the one path from a request to an ``EngineRequest``: each refusal is a
``RequestError`` naming the field and the HTTP status, a request is validated and its grammar compiled once, and
``add_request`` takes the result as it is."""

import base64
import io
import os

import numpy as np
import pytest
import soundfile

from fastdeploy_ext import LLM, SamplingParams
from fastdeploy_ext.engine.chat_adapter import ChatFormat
from fastdeploy_ext.engine.errors import RequestError, RequestTypeError
from fastdeploy_ext.engine.guided_decoding import GuidedDecodingParams
from fastdeploy_ext.engine.processor import ChatTemplate, EngineRequest, InputPolicy, InputProcessor, PromptInputs
from fastdeploy_ext.tiny import write_tiny

GREEDY = SamplingParams(temperature=0.0, max_tokens=3)


def wav(seconds: float, rate: int = 16000, seed: int = 7) -> bytes:
    samples = (np.random.default_rng(seed).standard_normal(int(seconds * rate)) * 0.1).astype(np.float32)
    buf = io.BytesIO()
    soundfile.write(buf, samples, rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def audio_part(data: bytes) -> dict:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": "wav"}}


@pytest.fixture(scope="module")
def llm(tiny_qwen2_dir):
    return LLM(model=tiny_qwen2_dir, max_model_len=64)


@pytest.fixture(scope="module")
def audio_processor(tmp_path_factory):
    """The CLI's way: the input path of a MiDashengLM built without weights, under a server-like policy."""
    from fastdeploy_ext.engine.engine import EngineArgs, build_fd_config, build_model
    from fastdeploy_ext.engine.tokenizer import Tokenizer

    d = str(tmp_path_factory.mktemp("dasheng"))
    write_tiny("MiDashengLMModel", d, seed=0)
    media = tmp_path_factory.mktemp("media")
    (media / "clip.wav").write_bytes(wav(1.0))
    model_cls, fd = build_fd_config(EngineArgs(model=d, max_model_len=1024))
    policy = InputPolicy(local_media_root=str(media), max_audio_seconds=3, max_request_audio_seconds=5)
    tokenizer = Tokenizer.from_pretrained(d)
    proc = InputProcessor(tokenizer, build_model(model_cls, fd, load=False), fd.scheduler_config.max_model_len,
                          fd.model_config.vocab_size, chat_format=ChatFormat(tokenizer), policy=policy)
    return proc, media


def refused(fn, *args, field, status=400, match=None, **kwargs) -> RequestError:
    with pytest.raises(RequestError, match=match) as e:
        fn(*args, **kwargs)
    assert (e.value.field, e.value.status) == (field, status)
    assert isinstance(e.value, ValueError)
    return e.value


def test_prompt_checks_name_the_field(llm):
    proc = llm.processor
    refused(proc.process, "", GREEDY, field="prompt", match="prompt is empty")
    refused(proc.process, None, GREEDY, list(range(1, 65)), field="prompt", match="64 tokens; max_model_len is 64")
    refused(proc.process, None, GREEDY, [1, 99999], field="prompt", match="token id 99999 outside the vocabulary")
    # against a pool of 5 pages of 4 tokens: 17 tokens need 5 pages, 21 need 6
    small = InputProcessor(llm.tokenizer, llm.llm_engine.model, 64, llm.llm_engine.vocab_size, num_kv_blocks=5,
                           block_size=4)
    small.validate(list(range(1, 18)), GREEDY)
    refused(small.validate, list(range(1, 22)), GREEDY, field="prompt", match="needs 6 KV blocks but the pool has 5")
    refused(proc.process, None, SamplingParams(stop_token_ids=[99999]), [1, 2], field="stop_token_ids",
            match="stop_token_ids: token id 99999")
    e = refused(proc.process, None, GREEDY, ["a", 2], field="prompt", match="token ids must be ints")
    assert isinstance(e, TypeError) and isinstance(e, RequestTypeError)
    e = refused(proc.process, None, GREEDY, [1, 2], cache_salt=5, field="cache_salt", match="must be a str")
    assert isinstance(e, TypeError)
    # a batch names the input; the error keeps its type, field and status
    outer = e.within("prompts[3]")
    assert str(outer).startswith("prompts[3]: 'cache_salt'") and isinstance(outer, RequestTypeError)
    assert (outer.field, outer.status) == ("cache_salt", 400)


def test_policy_caps(llm):
    proc = InputProcessor.for_engine(llm.llm_engine, llm.chat_format,
                                     InputPolicy(max_prompt_chars=17, max_stop_strings=1, max_stop_chars=5,
                                                 max_tokens_limit=255, check_context=True))
    refused(proc.encode, "x" * 18, "prompt", field="prompt", match="18 characters; the limit is max_prompt_chars=17")
    refused(proc.check_stops, ["a", "b"], field="stop", match="'stop' has 2 strings; the limit is 1")
    refused(proc.check_stops, ["abcdef"], field="stop", match="6 characters together; the limit is 5")
    assert proc.cap_max_tokens(None, "max_tokens", default=16) == 16 and proc.cap_max_tokens(255, "max_tokens") == 255
    refused(proc.cap_max_tokens, 257, "max_completion_tokens", field="max_completion_tokens",
            match="'max_completion_tokens' is 257; this server allows at most 255")
    refused(proc.process, None, SamplingParams(max_tokens=60), list(range(1, 6)), field="max_tokens",
            match="maximum context length is 64 tokens; the request asks for 65")
    # the offline policy lets generation stop at max_model_len instead
    assert llm.processor.process(None, SamplingParams(max_tokens=60), list(range(1, 6))).params.max_tokens == 60


def test_one_validation_one_compile_and_add_request_takes_the_request(llm):
    gd = GuidedDecodingParams(choice=["yes", "no"])
    params = SamplingParams(temperature=1.0, seed=17, max_tokens=4, n=2, guided_decoding=gd)
    request = llm.processor.process("is it?", params)
    assert isinstance(request, EngineRequest) and request.matcher is not None and request.reasoning_open is False
    reqs = llm.llm_engine.add_request("once", request)
    # the compiled matcher is the one the processor made (not compiled again); the sibling gets a copy
    assert reqs[0].matcher is request.matcher and reqs[1].matcher is not request.matcher
    while llm.llm_engine.has_unfinished_requests():
        llm.llm_engine.step()
    refused(llm.processor.process, "q", SamplingParams(guided_decoding=GuidedDecodingParams(grammar="root ::= nope")),
            field="grammar", match="not a Lark or GBNF grammar")
    # a raw add_request goes through the same build: the same refusal
    with pytest.raises(RequestError, match="prompt is empty"):
        llm.llm_engine.add_request("raw", None, [], GREEDY)
    assert not llm.llm_engine.has_unfinished_requests()


def test_chat_steps(llm):
    proc = InputProcessor.for_engine(llm.llm_engine, llm.chat_format, InputPolicy(trust_request_templates=False,
                                                                                  strict_template_kwargs=True))
    messages = [{"role": "user", "content": "hello"}]
    text = proc.render(messages)
    assert text == llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert proc.render(messages, template=ChatTemplate(add_generation_prompt=False)) != text
    refused(proc.render, messages, template=ChatTemplate(template="{{ 1 }}"), field="chat_template",
            match="does not run client-supplied chat templates")
    refused(proc.render, messages, template=ChatTemplate(kwargs={"enable_thinkin": True}),
            field="chat_template_kwargs", match="'enable_thinkin' is not a variable of the chat template")
    # the offline policy runs a caller's template in-process and passes keywords as given
    assert llm.processor.render(messages, template=ChatTemplate(template="[{{ messages[0].content }}]",
                                                                kwargs={"unused": 1})) == "[hello]"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    refused(proc.with_tools, GREEDY, None, "required", field="tool_choice", match="needs 'tools'")
    refused(proc.with_tools, GREEDY.clone(guided_decoding=GuidedDecodingParams(regex="a")), tools, "required",
            "guided_regex", field="guided_regex", match="'guided_regex' cannot be combined with tool_choice")
    forced, field = proc.with_tools(GREEDY, tools, {"type": "function", "function": {"name": "f"}})
    assert field == "tool_choice" and forced.guided_decoding is not None
    assert proc.with_tools(GREEDY, tools, "auto") == (GREEDY, None)
    e = refused(llm.chat, [{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False, tools=tools,
                tool_choice={"type": "function", "function": {"name": "g"}}, field="tool_choice",
                match=r"conversation 0: tool_choice: the function 'g' is not among 'tools'")
    assert e.message.startswith("conversation 0: ")
    refused(proc.audio_parts, [{"role": "user", "content": [audio_part(wav(1.0))]}], field="messages.0.content.0",
            match=r"messages\.0\.content\.0: Qwen2ForCausalLM takes text only")


def test_audio_parts(audio_processor):
    proc, media = audio_processor
    text = {"type": "text", "text": "what is it"}

    def parts(*content):
        return proc.audio_parts([{"role": "system", "content": "be brief"}, {"role": "user", "content": list(content)}])

    got = parts(text, audio_part(wav(1.0)), {"type": "audio_url", "audio_url": {"url": (media / "clip.wav").as_uri()}})
    assert [p.field for p in got] == ["messages.1.content.1", "messages.1.content.2"]
    assert isinstance(got[0].source, bytes) and got[1].source == os.path.realpath(media / "clip.wav")
    refused(parts, text, {"type": "input_audio", "input_audio": {"data": "@@", "format": "wav"}},
            field="messages.1.content.1", match="not valid base64")
    e = refused(parts, {"type": "input_audio", "input_audio": "abc"}, field="messages.1.content.0", match="expected")
    assert isinstance(e, TypeError)
    refused(parts, {"type": "audio_url", "audio_url": {"url": "https://example.com/a.wav"}},
            field="messages.1.content.0", match="unsupported audio URL scheme 'https'")
    refused(parts, {"type": "audio_url", "audio_url": {"url": f"file://{media}/clip.wav%00.txt"}},
            field="messages.1.content.0", match="NUL byte")
    refused(parts, {"type": "audio_url", "audio_url": {"url": f"file://{media}/../elsewhere.wav"}},
            field="messages.1.content.0", match="outside the allowed media path")
    refused(parts, {"type": "audio_url", "audio_url": {"url": f"file://{media}/none.wav"}},
            field="messages.1.content.0", match="audio file not found")
    # by the header, before anything is decoded: one clip past max_audio_seconds, then the request's budget
    before = proc.counts()["audio_frames_decoded"]
    refused(parts, audio_part(wav(3.5)), field="messages.1.content.0", match="3.5 s long by its header")
    refused(parts, audio_part(wav(2.5)), audio_part(wav(2.6, seed=8)), field="messages.1.content.1",
            match="max_request_audio_seconds=5")
    assert proc.counts()["audio_frames_decoded"] == before
    wave = proc.decode_audio(got[0])
    assert wave.shape == (16000,) and proc.counts()["audio_frames_decoded"] == before + 16000


def test_prepare_runs_the_multimodal_processor(audio_processor):
    proc, _ = audio_processor
    refused(proc.prepare, "two <|AUDIO|> <|AUDIO|>", field="prompt", where="prompt.1",
            match=r"^prompt\.1: the prompt has 2 <\|AUDIO\|> placeholder\(s\) but 0 audio clip\(s\)")
    clip = np.random.default_rng(255).standard_normal(16000).astype(np.float32) * np.float32(0.1)
    inputs = proc.prepare("<|AUDIO|>hi", multimodal_data={"audio": [clip]})
    assert isinstance(inputs, PromptInputs) and inputs.multimodal_inputs is not None
    audio_id = proc.tokenizer.token_to_id("<|AUDIO|>")
    assert inputs.token_ids.count(audio_id) == inputs.multimodal_inputs.num_tokens[0] > 1
    chat = proc.prepare_chat([{"role": "user", "content": [audio_part(wav(1.0)), {"type": "text", "text": "hi"}]}],
                             audio=[clip])
    assert chat.token_ids.count(audio_id) == inputs.multimodal_inputs.num_tokens[0]
    refused(proc.prepare_chat, [{"role": "user", "content": [audio_part(wav(1.0))]}], field="messages",
            match="^audio input: the prompt has 1")
