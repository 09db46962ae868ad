"""``fastdeploy-ext`` command line: ``demo``, ``make-tiny``, ``generate``, ``serve``, ``plan``, ``align``.

A user's mistake (a bad flag, a value out of range, a prompt the model cannot take, a busy port) is one
``error:`` line on stderr and exit status 2, and it is found before any weight is read.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

from fastdeploy_ext.quiet import silence_paddle

PROG = "fastdeploy-ext"


class UsageError(Exception):
    """A mistake in what the user asked for: printed as one ``error:`` line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        self.exit(2, f"error: {message} (`{self.prog} --help` lists the options)\n")


class _Help(argparse.RawDescriptionHelpFormatter):
    """Each option's default follows its help, unless the help already says it or there is none to say."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (not action.option_strings or action.default is None or action.default is False
                or action.default == argparse.SUPPRESS or "default" in text.lower()):
            return text
        return f"{text.rstrip('.')} (default: %(default)s)."


def _int_at_least(low: int):
    def parse(value: str) -> int:
        try:
            n = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {value!r}") from None
        if n < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {n}")
        return n

    return parse


def _flag_names(message: str) -> str:
    """``SamplingParams.top_p: ...`` -> ``--top-p: ...``: say what the user typed."""
    return re.sub(r"SamplingParams\.(\w+)", lambda m: "--" + m.group(1).replace("_", "-"), message)


def _one_line(message: str) -> str:
    return " ".join(str(message).split())


# ---- tiny checkpoints


def _write_tiny_into(arch: str, out_dir: str, force: bool, seed: int = 0, **kwargs) -> None:
    from fastdeploy_ext.tiny import tiny_checkpoint_arch, write_tiny

    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise UsageError(f"{out_dir} exists and is not a directory")
    if os.path.isdir(out_dir) and os.listdir(out_dir) and tiny_checkpoint_arch(out_dir) != arch and not force:
        raise UsageError(f"{out_dir} is not empty and does not hold a tiny {arch} checkpoint; choose another "
                         "directory or pass --force to write into it anyway")
    write_tiny(arch, out_dir, seed=seed, **kwargs)


def _cmd_make_tiny(args) -> int:
    extra = {"dtype": args.dtype} if args.dtype else {}
    if args.shards != 1:
        extra["shards"] = args.shards
    _write_tiny_into(args.arch, args.out, args.force, seed=args.seed, **extra)
    print(f"wrote tiny {args.arch} checkpoint to {args.out}")
    return 0


def _print_outputs(outputs) -> None:
    for out in outputs:
        print(f"--- request {out.request_id} ({len(out.prompt_token_ids)} prompt tokens, "
              f"finish_reason={out.outputs.finish_reason})")
        print(f"prompt:     {out.prompt!r}")
        print(f"completion: {out.outputs.text!r}")


def _cmd_demo(args) -> int:
    from fastdeploy_ext.tiny import demo_architecture, tiny_checkpoint_arch

    out_dir = args.out
    arch = demo_architecture()
    if args.force or tiny_checkpoint_arch(out_dir) != arch:
        _write_tiny_into(arch, out_dir, args.force)
        print(f"wrote a tiny random {arch} checkpoint to {out_dir}")
    from fastdeploy_ext import LLM, SamplingParams

    llm = LLM(model=out_dir, max_model_len=1024, max_num_seqs=8)
    prompts = ["hello world", "the music of the day", "你好 世界", "write a number: 42"]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24))
    _print_outputs(outputs)
    chat = llm.chat([{"role": "user", "content": "please answer the question"}],
                    SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=24))
    _print_outputs(chat)
    print("(random weights: the text is gibberish by construction; the engine path is what runs)")
    return 0


# ---- generate


def _engine_kwargs(args) -> dict:
    """The engine arguments ``generate`` took as flags (all but the checkpoint, given on its own)."""
    return {name: getattr(args, name) for name in args.engine_fields if name != "model"}


def _generate_requests(args):
    """The sampling parameters and one request per ``--prompt``, put through the input path ``LLM.generate`` takes
    (engine/processor.py) on the model built without weights, so that no mistake waits for the weights to load."""
    from fastdeploy_ext.engine.engine import EngineArgs, build_fd_config, build_model
    from fastdeploy_ext.engine.errors import RequestError
    from fastdeploy_ext.engine.processor import AudioPart, InputProcessor
    from fastdeploy_ext.engine.sampling_params import SamplingParams
    from fastdeploy_ext.engine.tokenizer import Tokenizer

    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                                seed=args.seed)
    except ValueError as e:
        raise UsageError(_flag_names(str(e))) from None
    model_cls, fd_config = build_fd_config(EngineArgs(model=args.model, **_engine_kwargs(args)))
    model = build_model(model_cls, fd_config, load=False)
    processor = InputProcessor(Tokenizer.from_pretrained(args.model), model, fd_config.scheduler_config.max_model_len,
                               fd_config.model_config.vocab_size)
    requests = []
    try:
        if args.audio:
            processor.require_audio("--audio")
        clips = [processor.decode_audio(AudioPart(path, f"--audio {path}")) for path in args.audio or ()]
        for i, text in enumerate(args.prompt):
            where = f"--prompt #{i + 1}" if len(args.prompt) > 1 else "--prompt"
            if clips:
                text = processor.place_audio(text, len(clips), "--audio")
            inputs = processor.prepare(text, multimodal_data={"audio": clips} if clips else None, field=where,
                                       where=where)
            processor.validate(inputs.token_ids, params, where)
            requests.append({"prompt": text, "multimodal_data": {"audio": clips}} if clips else text)
    except RequestError as e:
        raise UsageError(e.message.replace("max_model_len", "--max-model-len")) from None
    return params, requests


def _check_model_dir(model: str, flag: str = "--model") -> None:
    """A missing checkpoint directory, found before Paddle is imported (seconds)."""
    if not os.path.isdir(model):
        raise UsageError(f"{flag} {model}: no such directory")
    if not os.path.isfile(os.path.join(model, "config.json")):
        raise UsageError(f"{flag} {model}: no config.json there (a checkpoint directory holds config.json, "
                         "the safetensors weights and tokenizer.json)")


def _cmd_generate(args) -> int:
    _check_model_dir(args.model)
    params, requests = _generate_requests(args)
    from fastdeploy_ext import LLM

    with LLM(model=args.model, **_engine_kwargs(args)) as llm:
        try:
            outputs = llm.generate(requests, params, use_tqdm=not args.no_tqdm)
        except KeyboardInterrupt:
            done = llm.finished_outputs()
            _print_outputs(done)
            print(f"interrupted: {len(done)} of {len(requests)} request(s) had finished (printed above)",
                  file=sys.stderr)
            return 130
        _print_outputs(outputs)
    return 0


# ---- serve and plan


def _flag_kind(f) -> type:
    """What a flag's text converts to: the field's type; a size or a mapping stays a string for the config to parse."""
    from fastdeploy_ext.engine.args import value_types

    types = value_types(f)
    if int in types and float not in types and str not in types:
        return int
    return float if float in types and str not in types else str


def _checked(f, kind: type):
    """Converts a flag's text and checks the field's allowed values, so that a bad value is refused before anything
    loads."""
    from fastdeploy_ext.engine.args import spec_of

    def parse(value: str):
        try:
            converted = kind(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, got "
                                             f"{value!r}") from None
        why = spec_of(f).problem(converted)
        if why:
            raise argparse.ArgumentTypeError(f"{why}, got {repr(value) if kind is str else value}")
        return converted

    return parse


def _add_arg_flags(p: argparse.ArgumentParser, fields, from_config: bool) -> tuple[str, ...]:
    """One ``--kebab-case`` flag per field (engine/args.py), with the field's sentence, choices and default; a field
    whose flag the command already has (``generate --seed`` seeds the sampling) is left out. ``from_config``: the
    flags default to "not given", so that a config file's value stands unless a flag is given, and the config names
    a bad value's field; otherwise they default to the field's default and check the value when parsed. Returns the
    names of the fields given flags."""
    from dataclasses import MISSING

    from fastdeploy_ext.engine.args import spec_of, value_types

    added = []
    for f in fields:
        spec, flag = spec_of(f), "--" + f.name.replace("_", "-")
        if flag in p._option_string_actions:
            continue
        added.append(f.name)
        help_ = spec.help
        if from_config and f.default not in (None, MISSING) and "default" not in help_.lower():
            help_ = f"{help_.rstrip('.')} (default: {f.default})."
        help_ = help_.replace("%", "%%")
        required = not from_config and f.default is MISSING
        default = None if from_config or required else f.default
        if bool in value_types(f):
            p.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=default, help=help_)
            continue
        kind = _flag_kind(f)
        metavar = None if spec.choices else spec.metavar or {int: "N", float: "X"}.get(kind, "VALUE")
        # argparse itself refuses a value outside the choices, with the list.
        p.add_argument(flag, dest=f.name, type=kind if from_config or spec.choices else _checked(f, kind),
                       default=default, required=required, choices=spec.choices or None, metavar=metavar, help=help_)
    return tuple(added)


def _add_deploy_flags(p: argparse.ArgumentParser, server: bool) -> None:
    """``--config`` plus one ``--kebab-case`` flag per deployment-config field (``plan`` offers only the fields the
    memory plan depends on); a given flag wins over the file."""
    from dataclasses import fields

    from fastdeploy_ext.engine.args import EngineArgs, FrontendArgs
    from fastdeploy_ext.entrypoints.deploy_config import PLAN_FIELDS, SCHEMA, DeploymentArgs, ServerArgs

    p.add_argument("--config", metavar="FILE", help="YAML deployment config (configs/*.yaml); any flag below "
                   "overrides the field of the same name.")
    groups = (("engine (the keywords of LLM too)", EngineArgs), ("chat front end (LLM keywords too)", FrontendArgs),
              ("deployment", DeploymentArgs), ("server", ServerArgs))
    for title, cls in groups:
        chosen = [SCHEMA[f.name] for f in fields(cls) if server or f.name in PLAN_FIELDS]
        if chosen:
            _add_arg_flags(p.add_argument_group(title), chosen, from_config=True)


def _deploy_config(args):
    from fastdeploy_ext.entrypoints.deploy_config import FIELDS, load_config

    if args.config is None and args.model is None:
        raise UsageError("give --config FILE or --model DIR")
    return load_config(args.config, {k: getattr(args, k) for k in FIELDS if hasattr(args, k)})


def _model_where(cfg) -> str:
    return "--model" if cfg.source in ("command line", "<flags>") else f"{cfg.source}: field 'model'"


def _ensure_model(cfg) -> None:
    """Demo configs name a tiny architecture: write its random checkpoint on first use. Otherwise the
    checkpoint directory must be there (checked before Paddle is imported)."""
    if not cfg.tiny_arch:
        if cfg.model_info is None:
            _check_model_dir(cfg.model, _model_where(cfg))
        return
    from fastdeploy_ext.tiny import tiny_checkpoint_arch

    if tiny_checkpoint_arch(cfg.model) != cfg.tiny_arch and not os.path.exists(os.path.join(cfg.model, "config.json")):
        _write_tiny_into(cfg.tiny_arch, cfg.model, force=False)
        print(f"wrote a tiny random {cfg.tiny_arch} checkpoint to {cfg.model}", file=sys.stderr)


def _cmd_plan(args) -> int:
    cfg = _deploy_config(args)
    _ensure_model(cfg)
    from fastdeploy_ext.entrypoints.planner import plan

    result = plan(cfg, length=args.length)
    if args.json:
        import json

        print(json.dumps(result.as_dict(), indent=2))
    else:
        print(result.table())
    sys.stdout.flush()
    return 0 if result.fits else 1


def _listen(host: str, port: int):
    """Bind the server's socket now, so a busy port is reported before the model loads; uvicorn serves on it."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise UsageError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


def _cmd_serve(args) -> int:
    import logging

    logging.getLogger().setLevel(args.log_level.upper())
    cfg = _deploy_config(args)
    if not cfg.tiny_arch:
        _check_model_dir(cfg.model, _model_where(cfg))
    sock = _listen(cfg.host, cfg.port)
    try:
        from fastdeploy_ext.entrypoints.deploy_config import engine_args, resolve_api_key, server_limits
        from fastdeploy_ext.entrypoints.planner import plan

        api_key = resolve_api_key(cfg)
        _ensure_model(cfg)
        result = plan(cfg)
        if not result.fits:
            print(result.table(), file=sys.stderr)
            raise UsageError(f"{cfg.source}: this deployment does not fit: {result.reason}")
        from fastdeploy_ext.engine.engine import LLMEngine
        from fastdeploy_ext.entrypoints.openai_server import OpenAIServer, run_server, startup_summary

        chat_template = None
        if cfg.chat_template is not None:
            try:
                with open(cfg.chat_template, encoding="utf-8") as f:
                    chat_template = f.read()
            except OSError as e:
                raise UsageError(f"{cfg.source}: field 'chat_template': cannot read {cfg.chat_template}: {e}") from None
        engine = LLMEngine(cfg.model, **engine_args(cfg))
        server = OpenAIServer(engine, cfg.model_name, cfg.model, max_pending_requests=cfg.max_pending_requests,
                              api_key=api_key, allowed_local_media_path=cfg.allowed_local_media_path,
                              limits=server_limits(cfg), stats_interval=cfg.stats_interval,
                              tool_call_parser=cfg.tool_call_parser, chat_template=chat_template)
        host, port = sock.getsockname()[:2]
        for line in startup_summary(engine, cfg, f"http://{host}:{port}/v1", api_key is not None):
            logging.getLogger("fastdeploy_ext.server").info("%s", line)
        try:
            why = run_server(server, sock, log_level=args.log_level, drain_timeout_s=cfg.drain_timeout_s)
        finally:
            engine.shutdown()
    finally:
        sock.close()
    if server.loop.failure is not None:
        # exit non-zero so that a supervisor (systemd, Kubernetes) restarts the server and its ranks
        print(f"error: {_one_line(server.loop.failure)}", file=sys.stderr)
        return 1
    aborted = server.loop.num_drain_aborted
    print(f"{PROG} serve: stopped by {why}; "
          + (f"{aborted} request(s) still running after the {cfg.drain_timeout_s:g} s drain were aborted"
             if aborted else "no request was cut short"), file=sys.stderr)
    return 0


# ---- align


def _cmd_align(args) -> int:
    from fastdeploy_ext.entrypoints.align import (
        MissingExtraError,
        plot_statistics,
        require_align_extra,
        run_alignment,
    )

    if not args.threshold > 0:
        raise UsageError(f"--threshold must be > 0, got {args.threshold}")
    try:
        require_align_extra(plot=args.plot is not None)
        import transformers

        # The HF MiniMax load report lists the decay buffers it recomputes, which are not in a checkpoint by design.
        transformers.logging.set_verbosity_error()
        result = run_alignment(args.model, args.prompt, args.audio, reference_dir=args.reference,
                               threshold=args.threshold, max_model_len=args.max_model_len)
    except (MissingExtraError, ValueError) as e:
        raise UsageError(str(e)) from None
    print(result.report())
    if args.plot:
        plot_statistics(result.rows, result.threshold, args.plot,
                        f"{result.arch} vs reference ({result.num_tokens} tokens)")
        print(f"wrote {args.plot}")
    return 0 if result.diverging is None else 1


# ---- parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    from fastdeploy_ext import __version__

    try:
        paddle = version("paddlepaddle")
    except PackageNotFoundError:
        paddle = "not installed"
    return f"{PROG} {__version__} (paddlepaddle {paddle}, Python {sys.version.split()[0]})"


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, formatter_class=_Help, allow_abbrev=False,
                description="Serve MiniMax-M1 and MiDashengLM (and Qwen2) on a FastDeploy-style PaddlePaddle "
                "engine.\nStart with `fastdeploy-ext demo`; `fastdeploy-ext COMMAND --help` describes a command.")
    p.add_argument("--version", action="version", version=_version(), help="Print the package, Paddle and Python "
                   "versions and exit.")
    sub = p.add_subparsers(dest="command", title="commands", metavar="COMMAND")

    def command(name: str, help_: str, description: str | None = None):
        return sub.add_parser(name, help=help_, description=description or help_, formatter_class=_Help,
                              allow_abbrev=False)

    d = command("demo", "Write a tiny random Qwen2 checkpoint (offline) and generate with it.")
    d.add_argument("--out", default=os.path.join("tiny_models", "qwen2"),
                   help="Directory of the tiny checkpoint: written when empty or absent, reused when it holds the "
                   "demo's checkpoint.")
    d.add_argument("--force", action="store_true", help="Write the checkpoint even into a directory that holds "
                   "something else (its files of the same names are replaced).")
    d.set_defaults(func=_cmd_demo)

    from fastdeploy_ext.tiny import tiny_architectures

    m = command("make-tiny", "Write a tiny random checkpoint: config.json, safetensors and a trained tokenizer.")
    m.add_argument("--arch", required=True, choices=tiny_architectures(), help="Architecture, as config.json's "
                   "architectures[0] names it.")
    m.add_argument("--out", required=True, metavar="DIR", help="Output directory; must be empty, absent, or hold a "
                   "tiny checkpoint of the same architecture (see --force).")
    m.add_argument("--seed", metavar="N", type=int, default=0, help="Seed of the random weights.")
    m.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="Dtype of the stored weights.")
    m.add_argument("--shards", metavar="N", type=_int_at_least(1), default=1, help="Number of safetensors files; more than one "
                   "also writes model.safetensors.index.json.")
    m.add_argument("--force", action="store_true", help="Write into a directory that holds something else (files "
                   "of the same names are replaced).")
    m.set_defaults(func=_cmd_make_tiny)

    g = command("generate", "Generate text for one or more prompts from a checkpoint directory.",
                "Generate text for one or more prompts from a checkpoint directory. Every setting and prompt is "
                "checked\nbefore the weights are read.")
    from dataclasses import fields

    from fastdeploy_ext.engine.args import EngineArgs

    # The checkpoint first; the other engine flags follow the prompt and sampling flags.
    given = _add_arg_flags(g, [f for f in fields(EngineArgs) if f.name == "model"], from_config=False)
    g.add_argument("--prompt", required=True, action="append", metavar="TEXT", help="Prompt text; repeat the flag "
                   "for several prompts, which run as one batch.")
    g.add_argument("--audio", action="append", metavar="FILE", help="Audio clip for MiDashengLM (WAV, FLAC, OGG, "
                   "MP3; resampled to 16 kHz); repeat for several. Every prompt gets all clips; a prompt without "
                   "<|AUDIO|> gets one placeholder per clip in front.")
    g.add_argument("--max-tokens", metavar="N", type=_int_at_least(1), default=32, help="Most tokens to generate per prompt "
                   "(fewer when eos comes first or max_model_len is reached).")
    g.add_argument("--temperature", metavar="T", type=float, default=0.0, help="Sampling temperature; 0 always picks the most "
                   "likely token (greedy).")
    g.add_argument("--top-p", metavar="P", type=float, default=1.0, help="Sample only from the most likely tokens whose "
                   "probabilities add up to this much; 1 keeps them all.")
    g.add_argument("--seed", metavar="N", type=int, default=None, help="Sampling seed: the same seed gives the same text "
                   "(default: a different draw each run).")
    engine_fields = given + _add_arg_flags(g, [f for f in fields(EngineArgs) if f.name != "model"], from_config=False)
    g.set_defaults(engine_fields=engine_fields)
    g.add_argument("--no-tqdm", action="store_true", help="Do not show the progress bar.")
    g.set_defaults(func=_cmd_generate)

    s = command("serve", "OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /metrics).",
                "OpenAI-compatible HTTP server: POST /v1/completions and /v1/chat/completions, GET /v1/models,\n"
                "/health and /metrics. Settings come from --config (configs/*.yaml) and the flags, which win over\n"
                "the file; the port and the plan are checked before the model loads (docs/deployment.md).")
    _add_deploy_flags(s, server=True)
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="Level of the server's log (start-up summary, stats lines, rejected requests) and of "
                   "uvicorn's.")
    s.set_defaults(func=_cmd_serve)

    pl = command("plan", "Per-rank memory plan of a deployment (exit status 1 when it does not fit).",
                 "Per-rank memory plan of a deployment: weights, KV cache, state pool, activations, and the largest\n"
                 "max_num_seqs that fits. Exit status 0 when it fits, 1 when it does not.")
    _add_deploy_flags(pl, server=False)
    pl.add_argument("--gpu-memory", dest="device_memory", metavar="SIZE", help="Memory per card, e.g. 80GiB "
                    "(the same as --device-memory).")
    pl.add_argument("--length", metavar="N", type=_int_at_least(1), default=None, help="Sequence length at which the largest "
                    "max_num_seqs is computed (default: max_model_len).")
    pl.add_argument("--json", action="store_true", help="Print the numbers as JSON instead of a table.")
    pl.set_defaults(func=_cmd_plan)

    from fastdeploy_ext.entrypoints.align import DEFAULT_THRESHOLD

    a = command(
        "align", "Per-layer hidden states against the reference implementation (needs the align extra).",
        "Teacher-force one prompt through this implementation and the reference (CPU, fp32) and print,\n"
        "per row (embed, each decoder layer's output, final norm): mean and std of our hidden state, mean and max\n"
        "|ours - ref|, rel err = ||ours - ref|| / ||ref||, then the first row whose rel err exceeds --threshold.\n\n"
        "References (each model declares its own): Qwen2 and MiniMax -> the transformers class of the same\n"
        "architecture, MiniMax's RoPE patched to its partial rotation (transformers rotates the whole head;\n"
        "unpatched it would blame every correct full-attention layer); MiDashengLM -> the dasheng encoder + the\n"
        "projector in torch + transformers Qwen2.\n\n"
        'Needs the align extra: pip install -e ".[align]".\n'
        "Exit status: 0 no diverging layer, 1 a layer diverges, 2 missing dependency or bad input.")
    a.add_argument("--model", required=True, metavar="DIR", help="Checkpoint directory (our side, and the "
                   "reference's unless --reference is given).")
    a.add_argument("--reference", default=None, metavar="DIR", help="Load the reference from this checkpoint "
                   "instead of --model (e.g. the original when --model is a converted copy).")
    a.add_argument("--prompt", required=True, metavar="TEXT", help="Prompt text; for MiDashengLM a prompt without "
                   "<|AUDIO|> gets one audio placeholder per --audio in front.")
    a.add_argument("--audio", action="append", default=None, metavar="FILE", help="Audio file for MiDashengLM; "
                   "repeat for several clips.")
    a.add_argument("--threshold", metavar="X", type=float, default=DEFAULT_THRESHOLD, help="Relative error above which a layer "
                   "diverges; fp32 noise is ~1e-6.")
    a.add_argument("--plot", default=None, metavar="PNG", help="Also draw rel err per layer (log scale) into this "
                   "PNG file.")
    a.add_argument("--max-model-len", metavar="N", type=_int_at_least(2), default=None, help="Longest prompt accepted "
                   "(default: max_position_embeddings, at most 4096).")
    a.set_defaults(func=_cmd_align)
    return p


def main(argv=None) -> int:
    import logging

    silence_paddle()
    # Configured before paddle is imported: Paddle's import installs its own root handler otherwise.
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    _refuse_unknown_flags(parser, argv)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return args.func(args)
    except KeyboardInterrupt:  # before any output was ready (loading, warm-up): nothing to show
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader went away (`plan --json | head`): nothing more to say, and nothing left to flush
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as e:
        from fastdeploy_ext.engine.errors import RankFailure

        if isinstance(e, RankFailure):
            print(f"error: {_one_line(e)}", file=sys.stderr)
            return 1
        if not isinstance(e, _user_errors()):
            raise
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return 2


def _refuse_unknown_flags(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """Name an unknown ``--flag`` (argparse reports a missing required flag first, never naming the typo)."""
    import difflib

    sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    command = next((x for x in argv if not x.startswith("-")), None)
    target = sub.choices.get(command) if sub is not None and command else None
    known = set(parser._option_string_actions) | set(target._option_string_actions if target else ())
    for x in argv:
        if x == "--":
            break
        if x.startswith("--"):
            flag = x.split("=", 1)[0]
            if flag not in known:
                close = difflib.get_close_matches(flag, sorted(known), n=1)
                hint = f"; did you mean {close[0]}?" if close else ""
                (target or parser).error(f"unrecognized argument: {flag}{hint}")


def _user_errors() -> tuple:
    """Exceptions that describe the user's input. ``WeightLoadError`` (an unreadable or mismatched checkpoint)
    lives in a module that imports paddle: it can only have been raised once that module is loaded."""
    from fastdeploy_ext.config.base import ConfigError
    from fastdeploy_ext.engine.errors import RequestError

    errors = [UsageError, ConfigError, RequestError]
    utils = sys.modules.get("fastdeploy_ext.layers.utils")
    if utils is not None:
        errors.append(utils.WeightLoadError)
    return tuple(errors)


if __name__ == "__main__":
    sys.exit(main())
