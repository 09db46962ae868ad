"""Offline API with FastDeploy's names: ``LLM(...)``, ``generate``, ``chat``."""

from __future__ import annotations

import base64
import binascii
import dataclasses
import time
import urllib.parse
import urllib.request
from typing import Any

from fastdeploy_ext.engine.args import llm_docstring, llm_signature, split_keywords
from fastdeploy_ext.engine.engine import LLMEngine
from fastdeploy_ext.engine.output_processor import OutputProcessor, accumulate
from fastdeploy_ext.engine.request import RequestOutput
from fastdeploy_ext.engine.sampling_params import SamplingParams


class LLM:
    """``LLM(model=DIR, **keywords)`` loads a checkpoint directory (config.json + safetensors + tokenizer.json).

    The keywords are the fields of ``EngineArgs`` and ``FrontendArgs`` (engine/args.py), the same ones a deployment
    config and the command line take; a prompt dict may also carry ``"cache_salt"`` (cached prefixes are shared only
    among requests with the same salt). Keywords:

    """

    def __init__(self, model: str, **kwargs):
        from fastdeploy_ext.engine.chat_adapter import ChatFormat
        from fastdeploy_ext.engine.reasoning_parsers import resolve_reasoning_parser
        from fastdeploy_ext.engine.tool_parsers import default_tool_parser, get_tool_parser

        engine_args, front = split_keywords(model, kwargs)
        resolve_reasoning_parser(engine_args.reasoning_parser, "")  # a misspelt name fails before the weights load
        self.llm_engine = LLMEngine(**{f.name: getattr(engine_args, f.name) for f in dataclasses.fields(engine_args)})
        self.tokenizer = self.llm_engine.tokenizer
        parser = front.tool_call_parser or default_tool_parser(type(self.llm_engine.model).name())
        self.chat_format = ChatFormat(self.tokenizer, get_tool_parser(parser) if parser else None,
                                      self.llm_engine.reasoning_parser, front.chat_template)
        self._next_id = 0
        self._finished: dict[str, RequestOutput] = {}
        self.output_processor = OutputProcessor(self.tokenizer)

    def shutdown(self) -> None:
        """Stop the rank processes of a tensor-parallel engine (also done at interpreter exit)."""
        self.llm_engine.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    def _normalize(self, prompts) -> list[dict]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        elif isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
            prompts = [{"prompt_token_ids": prompts}]
        if not isinstance(prompts, list):
            raise TypeError(f"prompts must be a str, a list of str, token ids or dicts; got {type(prompts).__name__}")
        items = []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                items.append({"prompt": p})
            elif isinstance(p, list) and all(isinstance(t, int) for t in p):
                items.append({"prompt_token_ids": p})
            elif isinstance(p, dict) and ("prompt" in p or "prompt_token_ids" in p):
                items.append(p)
            else:
                raise TypeError(f"prompts[{i}]: expected a str, a list of token ids, or a dict with 'prompt' or "
                                f"'prompt_token_ids'; got {type(p).__name__}")
        return items

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Outputs in input order; with ``n > 1`` each prompt yields ``n`` consecutive outputs.
        Every prompt is validated before any is scheduled (errors name the prompt's index)."""
        items = self._normalize(prompts)
        if sampling_params is None:
            sampling_params = self.llm_engine.default_sampling_params()
        params_list = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(items)
        if len(params_list) != len(items):
            raise ValueError(f"got {len(params_list)} sampling_params for {len(items)} prompts")

        prepared = []
        for i, (item, params) in enumerate(zip(items, params_list)):
            try:
                text = item.get("prompt")
                if "prompt_token_ids" in item:
                    ids = list(item["prompt_token_ids"])
                else:
                    if not isinstance(text, str):
                        raise TypeError("'prompt' must be a str")
                    ids = self.tokenizer.encode(text, add_special_tokens=True)
                mm = item.get("multimodal_data")
                if mm is not None or hasattr(self.llm_engine.model, "multimodal_processor"):
                    # A multimodal model also checks text-only prompts (e.g. for stray media placeholders).
                    text, ids, mm = self._process_multimodal(text, ids, mm)
                self.llm_engine.validate_prompt(ids, params)
                salt = item.get("cache_salt")
                if salt is not None and not isinstance(salt, str):
                    raise TypeError("'cache_salt' must be a str")
            except (ValueError, TypeError) as e:
                raise type(e)(f"prompts[{i}]: {e}") from None
            prepared.append((text, ids, params, mm, salt))

        order = []
        for text, ids, params, mm, salt in prepared:
            rid = str(self._next_id)
            self._next_id += 1
            order.extend(r.request_id for r in self.llm_engine.add_request(rid, text, ids, params, mm, cache_salt=salt))
        finished = self._run(len(order), use_tqdm)
        return [finished[rid] for rid in order]

    def _process_multimodal(self, text, ids, mm):
        processor = getattr(self.llm_engine.model, "multimodal_processor", None)
        if processor is None:
            raise ValueError("multimodal_data given but this model takes text only")
        return processor(self.tokenizer, text, ids, mm)

    def chat(self, messages, sampling_params: SamplingParams | None = None, use_tqdm: bool = True,
             chat_template_kwargs: dict[str, Any] | None = None, chat_template: str | None = None,
             tools: list[dict] | None = None, tool_choice="auto") -> list[RequestOutput]:
        """``messages``: one conversation (OpenAI-shaped ``{"role", "content", "tool_calls", "tool_call_id"}``
        dicts, adapted to the template's shape) or a list of them. ``tools``: OpenAI function tools;
        ``tool_choice``: ``"auto"``, ``"none"``, ``"required"`` or ``{"type": "function", "function":
        {"name": ...}}`` (the last two enforced by guided decoding). ``outputs.text`` is the content; calls
        are in ``outputs.tool_calls`` and a reasoning section in ``outputs.reasoning_content``."""
        from fastdeploy_ext.engine.chat_adapter import ChatFormat

        fmt = self.chat_format
        if chat_template is not None:
            fmt = ChatFormat(self.tokenizer, fmt.tool_parser, fmt.reasoning_parser, chat_template)
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        params = sampling_params if sampling_params is not None else self.llm_engine.default_sampling_params()
        constraint = fmt.tool_constraint(tools, tool_choice)
        if constraint is not None:
            if params.guided_decoding is not None:
                raise ValueError("tool_choice 'required' or a named function cannot be combined with guided_decoding")
            params = params.clone(guided_decoding=constraint)
        prompts = []
        for conv in conversations:
            text = fmt.render(conv, tools, **(chat_template_kwargs or {}))
            prompt = {"prompt": text, "prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)}
            audio = _audio_parts(conv, f"conversation {len(prompts)}")
            if audio:
                prompt["multimodal_data"] = {"audio": audio}
            prompts.append(prompt)
        outputs = self.generate(prompts, params, use_tqdm)
        for out in outputs:
            opened = self.llm_engine.reasoning_open(out.prompt_token_ids)
            reasoning, content, calls = fmt.parse(out.outputs.text, bool(tools) and tool_choice != "none", opened)
            out.outputs.text = content or ""
            out.outputs.reasoning_content = reasoning
            out.outputs.tool_calls = calls
        return outputs

    def finished_outputs(self) -> list[RequestOutput]:
        """The outputs the last (possibly interrupted) :meth:`generate` had finished, in finishing order."""
        return list(self._finished.values())

    def _run(self, total: int, use_tqdm: bool) -> dict[str, RequestOutput]:
        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
        self._finished = finished  # readable after a KeyboardInterrupt
        partial: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)
        start, generated = time.perf_counter(), 0
        while engine.has_unfinished_requests():
            for delta in self.output_processor.step(engine):
                out = accumulate(partial, delta)
                if out is not None:
                    finished[out.request_id] = partial.pop(out.request_id)
                    generated += len(out.outputs.token_ids)
                    if bar is not None:
                        bar.update(1)
                        bar.set_postfix_str(f"output {generated / max(time.perf_counter() - start, 1e-9):.1f} tok/s")
        if bar is not None:
            bar.close()
        return finished


# help(LLM) and editors show every keyword with its default; the docstring lists their sentences.
LLM.__init__.__signature__ = llm_signature()
LLM.__doc__ += llm_docstring(indent="    ") + "\n"


def _audio_parts(conversation, where: str) -> list:
    """Audio sources of a conversation's ``input_audio`` / ``audio_url`` content parts, in message and part order
    (the order the chat template renders their placeholders): encoded ``bytes`` or a file path."""
    sources = []
    for m, message in enumerate(conversation):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for p, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("input_audio", "audio_url"):
                continue
            try:
                sources.append(_input_audio(part) if kind == "input_audio" else _audio_url(part))
            except (ValueError, TypeError) as e:
                raise type(e)(f"{where}: messages[{m}].content[{p}] ({kind}): {e}") from None
    return sources


def _input_audio(part: dict) -> bytes:
    """``{"type": "input_audio", "input_audio": {"data": <base64>, "format": "wav"}}`` -> encoded bytes."""
    body = part.get("input_audio")
    if not isinstance(body, dict) or not isinstance(body.get("data"), str):
        raise TypeError("expected {'input_audio': {'data': <base64 str>, 'format': ...}}")
    try:
        return base64.b64decode(body["data"], validate=True)
    except binascii.Error as e:
        raise ValueError(f"'data' is not valid base64: {e}") from None


def _audio_url(part: dict):
    """``{"type": "audio_url", "audio_url": {"url": ...}}`` with a ``file://`` or base64 ``data:`` URL -> a path or
    encoded bytes. Remote URLs are refused: the offline engine fetches nothing."""
    body = part.get("audio_url")
    url = body.get("url") if isinstance(body, dict) else body
    if not isinstance(url, str):
        raise TypeError("expected {'audio_url': {'url': <str>}}")
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme == "file":
        return urllib.request.url2pathname(parsed.path)
    if parsed.scheme == "data":
        header, _, data = parsed.path.partition(",")
        if not header.endswith(";base64"):
            raise ValueError("a data: audio URL must be base64-encoded (data:<mime>;base64,...)")
        try:
            return base64.b64decode(data, validate=True)
        except binascii.Error as e:
            raise ValueError(f"data: URL is not valid base64: {e}") from None
    raise ValueError(f"unsupported audio URL scheme {parsed.scheme!r} in {url[:80]!r}; use file:// or data:")
