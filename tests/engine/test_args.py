"""Engine arguments declared once (engine/args.py): LLM's keywords, the config schema and the CLI flags are the same
fields, with the same defaults, sentences and allowed values."""

import argparse
import dataclasses
import inspect
import pydoc

import pytest

from fastdeploy_ext.config.base import ConfigError
from fastdeploy_ext.engine.args import LLM_ARGS, EngineArgs, fields_of, spec_of
from fastdeploy_ext.entrypoints.cli import build_parser
from fastdeploy_ext.entrypoints.deploy_config import SCHEMA, engine_args, load_config


def _subparser(name: str) -> argparse.ArgumentParser:
    return next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices[name]


def _actions(name: str) -> dict:
    """``{field name: action}`` of the flags named after fields (aliases such as plan's --gpu-memory left out)."""
    return {opt[2:].replace("-", "_"): a for a in _subparser(name)._actions for opt in a.option_strings
            if opt.startswith("--")}


def test_llm_signature_and_docstring_list_every_keyword_with_its_default():
    from fastdeploy_ext import LLM

    params = inspect.signature(LLM).parameters
    fields = fields_of(*LLM_ARGS)
    assert list(params) == [f.name for f in fields]
    for f in fields:
        want = inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default
        assert params[f.name].default == want, f.name
    text = " ".join(pydoc.render_doc(LLM, renderer=pydoc.plaintext).split())
    assert "LLM(model: 'str', *, tokenizer: 'str | None' = None, tensor_parallel_size: 'int' = 1," in text
    for f in fields:
        assert f"``{f.name}``: " in text and spec_of(f).help.rstrip(".") in text, f.name


def test_an_unknown_keyword_is_named_with_the_closest_before_anything_loads(tmp_path):
    from fastdeploy_ext import LLM

    missing = str(tmp_path / "no-such-checkpoint")
    with pytest.raises(TypeError, match=r"LLM\(\) got an unexpected keyword argument 'max_num_seq'; did you mean "
                                        r"'max_num_seqs'\?"):
        LLM(model=missing, max_num_seq=4)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'zzz'; keywords: model, tokenizer, "):
        LLM(model=missing, zzz=1)


@pytest.mark.parametrize("kwargs, message", [
    ({"block_size": 0}, "block_size must be >= 1, got 0"),
    ({"max_num_seqs": "17"}, "max_num_seqs must be int, got '17'"),
    ({"enable_prefix_caching": 1}, "enable_prefix_caching must be bool/None, got 1"),
    ({"rank_heartbeat_timeout_s": 1.0}, "rank_heartbeat_timeout_s must be >= 2, got 1.0"),
], ids=["range", "type", "bool", "float_range"])
def test_keyword_values_are_checked_against_their_field_before_anything_loads(tmp_path, kwargs, message):
    from fastdeploy_ext import LLM

    with pytest.raises(ConfigError) as e:
        LLM(model=str(tmp_path / "no-such-checkpoint"), **kwargs)
    assert str(e.value) == message


@pytest.mark.parametrize("field, value, needle", [
    ("num_threads", 0, "field 'num_threads' must be >= 1, got 0"),
    ("seed", -1, "field 'seed' must be >= 0, got -1"),
    ("rank_heartbeat_timeout_s", 1, "field 'rank_heartbeat_timeout_s' must be >= 2, got 1"),
    ("gpu_memory_utilization", 1.5, "field 'gpu_memory_utilization' must be in (0, 1], got 1.5"),
    ("template_timeout_s", float("inf"), "field 'template_timeout_s' must be > 0, got inf"),
    ("dtype", "int8", "field 'dtype' must be one of auto, float32, float64, bfloat16, float16, got 'int8'"),
    ("device", "auto", "field 'device' must be one of cpu, gpu, got 'auto'"),
    ("tokenizer", 17, "field 'tokenizer' must be str/null, got 17"),
    ("enable_chunked_prefill", 1, "field 'enable_chunked_prefill' must be bool, got 1"),
], ids=lambda v: str(v)[:24])
def test_config_checks_come_from_the_field(field, value, needle):
    with pytest.raises(ConfigError) as e:
        load_config(None, {"model": "x", field: value})
    assert needle in str(e.value)


def test_every_engine_field_reaches_the_engine_from_a_config(tmp_path):
    tok = tmp_path / "tok"
    cfg = load_config(None, {"model": "m", "tokenizer": str(tok), "num_threads": 3, "rank_heartbeat_timeout_s": 17})
    kwargs = engine_args(cfg)
    assert set(kwargs) == {f.name for f in dataclasses.fields(EngineArgs)} - {"model"}
    assert (kwargs["tokenizer"], kwargs["num_threads"]) == (str(tok), 3)
    # An int written for a float field arrives as a float.
    assert kwargs["rank_heartbeat_timeout_s"] == 17.0 and isinstance(kwargs["rank_heartbeat_timeout_s"], float)
    assert EngineArgs(model="m", **kwargs).num_threads == 3


@pytest.mark.parametrize("command", ["generate", "serve", "plan"])
def test_flags_carry_the_field_sentence_choices_and_default(command):
    actions = _actions(command)
    # generate builds an engine (its own fields); serve and plan a deployment (the config's view of them).
    fields = {f.name: f for f in dataclasses.fields(EngineArgs)} if command == "generate" else SCHEMA
    shown = 0
    for name, f in fields.items():
        action = actions.get(name)
        if action is None or name == "seed" and command == "generate":
            continue  # generate's --seed is the sampling seed (checked below)
        shown += 1
        spec = spec_of(f)
        assert action.help.replace("%%", "%").startswith(spec.help.rstrip(".")), (command, name)
        assert tuple(action.choices or ()) == spec.choices, (command, name)
        if command == "generate":
            assert action.default == (None if f.default is dataclasses.MISSING else f.default), name
        else:
            assert action.default is None, name  # not given: the config file's value stands
    assert shown >= 17
    if command == "generate":
        assert "Sampling seed" in actions["seed"].help


def test_generate_checks_engine_flags_when_parsing():
    parser = build_parser()
    base = ["generate", "--model", "m", "--prompt", "hi"]
    args = parser.parse_args(base + ["--num-threads", "3", "--no-enable-chunked-prefill", "--block-size", "17"])
    assert (args.num_threads, args.enable_chunked_prefill, args.block_size) == (3, False, 17)
    for flag, value, message in (("--num-threads", "0", "must be >= 1, got 0"),
                                 ("--max-model-len", "1", "must be >= 2, got 1"),
                                 ("--rank-heartbeat-timeout-s", "soon", "expected a number, got 'soon'")):
        with pytest.raises(SystemExit):
            parser.parse_args(base + [flag, value])
        sub = _subparser("generate")
        action = next(a for a in sub._actions if flag in a.option_strings)
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            action.type(value)
