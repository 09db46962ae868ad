"""Offline API with FastDeploy's names: ``LLM(...)``, ``generate``, ``chat``."""

from __future__ import annotations

import dataclasses
import time
from functools import cached_property
from typing import Any

from fastdeploy_ext.config.base import ConfigError
from fastdeploy_ext.engine.args import llm_docstring, llm_signature, split_keywords
from fastdeploy_ext.engine.engine import LLMEngine
from fastdeploy_ext.engine.errors import RequestError
from fastdeploy_ext.engine.processor import ChatTemplate, EngineRequest, InputProcessor
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
        from fastdeploy_ext.engine.chat_adapter import ChatFormat, default_chat_adapter
        from fastdeploy_ext.engine.reasoning_parsers import resolve_reasoning_parser
        from fastdeploy_ext.engine.tool_parsers import default_tool_parser, get_tool_parser

        engine_args, front = split_keywords(model, kwargs)
        resolve_reasoning_parser(engine_args.reasoning_parser, "")  # a misspelt name fails before the weights load
        self.llm_engine = LLMEngine(**{f.name: getattr(engine_args, f.name) for f in dataclasses.fields(engine_args)})
        self.tokenizer = self.llm_engine.tokenizer
        architecture = type(self.llm_engine.model).name()
        parser = front.tool_call_parser or default_tool_parser(architecture)
        self.chat_format = ChatFormat(self.tokenizer, get_tool_parser(parser) if parser else None,
                                      self.llm_engine.reasoning_parser, front.chat_template,
                                      default_chat_adapter(architecture))
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

    @cached_property
    def processor(self) -> InputProcessor:
        """The input path of :meth:`generate` and :meth:`chat` (engine/processor.py)."""
        return InputProcessor.for_engine(self.llm_engine, chat_format=self.chat_format)

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Outputs in input order; with ``n > 1`` each prompt yields ``n`` consecutive outputs.
        Every prompt is validated before any is scheduled (errors name the prompt's index)."""
        items = self._normalize(prompts)
        params_list = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(items)
        if len(params_list) != len(items):
            raise ValueError(f"got {len(params_list)} sampling_params for {len(items)} prompts")
        requests = []
        for i, (item, params) in enumerate(zip(items, params_list)):
            try:
                requests.append(self.processor.process(item.get("prompt"), params, item.get("prompt_token_ids"),
                                                       item.get("multimodal_data"), item.get("cache_salt")))
            except RequestError as e:
                raise e.within(f"prompts[{i}]") from None
            except ConfigError as e:
                raise ConfigError(f"prompts[{i}]: {e}") from None
        return self._submit(requests, use_tqdm)

    def chat(self, messages, sampling_params: SamplingParams | None = None, use_tqdm: bool = True,
             chat_template_kwargs: dict[str, Any] | None = None, chat_template: str | None = None,
             tools: list[dict] | None = None, tool_choice="auto") -> list[RequestOutput]:
        """``messages``: one conversation (OpenAI-shaped ``{"role", "content", "tool_calls", "tool_call_id"}``
        dicts, adapted to the template's shape; audio as ``input_audio`` or ``file://``/``data:`` ``audio_url``
        parts) or a list of them. ``tools``: OpenAI function tools; ``tool_choice``: ``"auto"``, ``"none"``,
        ``"required"`` or ``{"type": "function", "function": {"name": ...}}`` (the last two enforced by guided
        decoding). ``outputs.text`` is the content; calls are in ``outputs.tool_calls`` and a reasoning section in
        ``outputs.reasoning_content``. Errors name the conversation (``conversation 1: ...``)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        template = ChatTemplate(kwargs=chat_template_kwargs, template=chat_template)
        requests = []
        for c, conversation in enumerate(conversations):
            try:
                requests.append(self.processor.process_chat(conversation, sampling_params, tools, tool_choice,
                                                            template))
            except RequestError as e:
                raise e.within(f"conversation {c}") from None
        outputs = self._submit(requests, use_tqdm)
        owners = [r for r in requests for _ in range(r.params.n)]
        parse_tools = bool(tools) and tool_choice != "none"
        for out, request in zip(outputs, owners):
            reasoning, content, calls = self.chat_format.parse(out.outputs.text, parse_tools, request.reasoning_open)
            out.outputs.text = content or ""
            out.outputs.reasoning_content = reasoning
            out.outputs.tool_calls = calls
        return outputs

    def _submit(self, requests: list[EngineRequest], use_tqdm: bool) -> list[RequestOutput]:
        order = []
        for request in requests:
            rid = str(self._next_id)
            self._next_id += 1
            order.extend(r.request_id for r in self.llm_engine.add_request(rid, request))
        finished = self._run(len(order), use_tqdm)
        return [finished[rid] for rid in order]

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
