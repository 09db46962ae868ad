"""Request fields that become engine inputs beyond sampling: structured-output constraints, ``logit_bias``
and tool definitions, each checked against its cap (a violation is a 400 naming the field)."""

from __future__ import annotations

import json

from fastdeploy_ext.engine.guided_decoding import MAX_SCHEMA_BYTES, GrammarBusy, GrammarError, GuidedDecodingParams
from fastdeploy_ext.entrypoints.protocol import APIError

_GUIDED_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                  "structured_outputs")
_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")


def guided_params_of(req) -> tuple[GuidedDecodingParams | None, str | None]:
    """``(params, request field)`` of the structured-output request fields (at most one may be set)."""
    rf = req.response_format
    given = [name for name in _GUIDED_FIELDS if getattr(req, name) is not None
             and not (name == "response_format" and rf.type == "text")]
    if len(given) > 1:
        raise APIError(400, f"at most one of {', '.join(_GUIDED_FIELDS)} may be set, got {', '.join(given)}",
                       param=given[1])
    if not given:
        return None, None
    field = given[0]
    if field == "structured_outputs":
        return _structured_outputs(req.structured_outputs)
    try:
        if field == "response_format":
            if rf.type == "json_object":
                return GuidedDecodingParams(json_object=True), field
            schema = rf.json_schema.schema_
            if schema is None:
                return GuidedDecodingParams(json_object=True), field
            return GuidedDecodingParams(json=schema), field
        if field == "guided_json":
            return GuidedDecodingParams(json=req.guided_json), field
        if field == "guided_regex":
            return GuidedDecodingParams(regex=req.guided_regex), field
        if field == "guided_choice":
            return GuidedDecodingParams(choice=req.guided_choice), field
        return GuidedDecodingParams(grammar=req.guided_grammar), field
    except ValueError as e:
        raise APIError(400, f"{field}: {e}", param=field) from None


def _structured_outputs(so) -> tuple[GuidedDecodingParams, str]:
    """vLLM's ``structured_outputs`` object; the field named in errors is ``structured_outputs.<key>``."""
    for name in ("whitespace_pattern", "structural_tag"):
        if getattr(so, name) is not None:
            raise APIError(400, f"'structured_outputs.{name}' is not supported", param=f"structured_outputs.{name}")
    values = {name: getattr(so, "json_" if name == "json" else name) for name in _CONSTRAINTS}
    given = [name for name, value in values.items() if value is not None and value is not False]
    if len(given) != 1:
        raise APIError(400, f"'structured_outputs' needs exactly one of {', '.join(_CONSTRAINTS)}, got "
                            f"{', '.join(given) or 'none'}", param="structured_outputs")
    field = f"structured_outputs.{given[0]}"
    value = values[given[0]]
    try:
        if given[0] == "json_object":
            schema = {"type": "object"}
            if so.disable_additional_properties:
                schema["additionalProperties"] = False
            return GuidedDecodingParams(json=schema), field
        if given[0] == "json":
            params = GuidedDecodingParams(json=value)
            if so.disable_additional_properties:
                try:
                    params.json = _closed(params.json)
                except RecursionError:
                    raise APIError(400, f"{field}: the schema is nested too deeply", param=field) from None
            return params, field
        return GuidedDecodingParams(**{given[0]: value}), field
    except ValueError as e:
        raise APIError(400, f"{field}: {e}", param=field) from None


def _closed(schema: dict) -> dict:
    """``schema`` with ``additionalProperties: false`` on each object schema that sets no
    ``additionalProperties`` (vLLM's ``disable_additional_properties``); iterative, so depth costs no stack."""
    out = json.loads(json.dumps(schema))
    stack = [out]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if (node.get("type") == "object" or "properties" in node) and "additionalProperties" not in node:
                node["additionalProperties"] = False
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return out


def logit_bias_of(req, vocab_size: int) -> dict[int, float] | None:
    """OpenAI's ``{"<token id>": bias}`` as ints; ids must be in the vocabulary and |bias| <= 100."""
    if not req.logit_bias:
        return None
    bias = {}
    for key, value in req.logit_bias.items():
        if not key.isdigit() or int(key) >= vocab_size:
            raise APIError(400, f"logit_bias: {key!r} is not a token id in [0, {vocab_size})", param="logit_bias")
        if not -100 <= value <= 100:
            raise APIError(400, f"logit_bias: the bias of token {key} is {value}; it must be in [-100, 100]",
                           param="logit_bias")
        bias[int(key)] = float(value)
    return bias


def tools_of(req) -> list[dict] | None:
    """The request's function tools as OpenAI dicts; each parameters schema within the schema cap."""
    if req.tools is None:
        return None
    tools = []
    for i, tool in enumerate(req.tools):
        d = tool.model_dump(exclude_none=True)
        size = len(json.dumps(d["function"].get("parameters", {})))
        if size > MAX_SCHEMA_BYTES:
            raise APIError(400, f"tools.{i}.function.parameters is {size} bytes; the limit is {MAX_SCHEMA_BYTES}",
                           param=f"tools.{i}.function.parameters")
        tools.append(d)
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise APIError(400, "tools: function names must be unique", param="tools")
    return tools


def generation_error(error: str, guided_field: str | None) -> APIError:
    """The error of a request that failed while generating: a grammar that fails at a later token (over
    llguidance's parser limits, or allowing nothing) is the client's, a 400 naming its field; else a 500."""
    if guided_field is not None and "guided decoding" in error:
        return APIError(400, f"{guided_field}: the grammar failed during generation: {error}", param=guided_field)
    return APIError(500, f"generation failed: {error}", "internal_server_error")


def grammar_error(e: GrammarError, field: str) -> APIError:
    if isinstance(e, GrammarBusy):
        return APIError(429, f"{field}: {e.message}", "rate_limit_exceeded", param=field)
    return APIError(400, f"{field}: {e.message}", param=field)
