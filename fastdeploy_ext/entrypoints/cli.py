"""``fastdeploy-ext`` command line: ``demo``, ``make-tiny``, ``generate``, ``serve``, ``plan``, ``align``."""

from __future__ import annotations

import argparse
import os
import sys


def _cmd_make_tiny(args) -> int:
    from fastdeploy_ext.tiny import write_tiny

    extra = {}
    if args.dtype:
        extra["dtype"] = args.dtype
    if args.shards != 1:
        extra["shards"] = args.shards
    write_tiny(args.arch, args.out, seed=args.seed, **extra)
    print(f"wrote tiny {args.arch} checkpoint to {args.out}")
    return 0


def _print_outputs(outputs) -> None:
    for out in outputs:
        print(f"--- request {out.request_id} ({len(out.prompt_token_ids)} prompt tokens, "
              f"finish_reason={out.outputs.finish_reason})")
        print(f"prompt:     {out.prompt!r}")
        print(f"completion: {out.outputs.text!r}")


def _cmd_generate(args) -> int:
    from fastdeploy_ext import LLM, SamplingParams

    llm = LLM(model=args.model, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens, seed=args.seed)
    _print_outputs(llm.generate(args.prompt, params, use_tqdm=not args.no_tqdm))
    return 0


def _cmd_demo(args) -> int:
    from fastdeploy_ext import LLM, SamplingParams
    from fastdeploy_ext.tiny import write_tiny

    out_dir = args.out
    if not os.path.exists(os.path.join(out_dir, "config.json")):
        write_tiny("Qwen2ForCausalLM", out_dir, seed=0)
        print(f"wrote a tiny random Qwen2 checkpoint to {out_dir}")
    llm = LLM(model=out_dir, max_model_len=1024, max_num_seqs=8)
    prompts = ["hello world", "the music of the day", "你好 世界", "write a number: 42"]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24))
    _print_outputs(outputs)
    chat = llm.chat([{"role": "user", "content": "please answer the question"}],
                    SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=24))
    _print_outputs(chat)
    print("(random weights: the text is gibberish by construction; the engine path is what runs)")
    return 0


def _add_deploy_flags(p: argparse.ArgumentParser) -> None:
    """``--config`` plus one ``--kebab-case`` flag per deployment-config field; a given flag wins over the file."""
    from fastdeploy_ext.entrypoints.deploy_config import _SCHEMA

    p.add_argument("--config", help="YAML deployment config (configs/*.yaml)")
    for name, (types, _, help_) in _SCHEMA.items():
        flag = "--" + name.replace("_", "-")
        if bool in types:
            p.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_)
        else:
            kind = int if int in types and float not in types and str not in types else (
                float if float in types and str not in types else str)
            p.add_argument(flag, dest=name, type=kind, default=None, help=help_)


def _deploy_config(args):
    from fastdeploy_ext.entrypoints.deploy_config import FIELDS, load_config

    if args.config is None and args.model is None:
        raise SystemExit("error: give --config FILE or --model DIR")
    return load_config(args.config, {k: getattr(args, k) for k in FIELDS})


def _ensure_model(cfg) -> None:
    """Demo configs name a tiny architecture: write its random checkpoint on first use."""
    if cfg.tiny_arch and not os.path.exists(os.path.join(cfg.model, "config.json")):
        from fastdeploy_ext.tiny import write_tiny

        write_tiny(cfg.tiny_arch, cfg.model, seed=0)
        print(f"wrote a tiny random {cfg.tiny_arch} checkpoint to {cfg.model}", file=sys.stderr)


def _cmd_plan(args) -> int:
    from fastdeploy_ext.entrypoints.planner import plan

    cfg = _deploy_config(args)
    _ensure_model(cfg)
    result = plan(cfg, length=args.length)
    if args.json:
        import json

        print(json.dumps(result.as_dict(), indent=2))
    else:
        print(result.table())
    return 0 if result.fits else 1


def _cmd_serve(args) -> int:
    import logging

    from fastdeploy_ext.config.base import ConfigError

    from fastdeploy_ext.engine.engine import LLMEngine
    from fastdeploy_ext.entrypoints.deploy_config import engine_args
    from fastdeploy_ext.entrypoints.openai_server import OpenAIServer, run_server
    from fastdeploy_ext.entrypoints.planner import plan

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = _deploy_config(args)
    _ensure_model(cfg)
    result = plan(cfg)
    if not result.fits:
        print(result.table(), file=sys.stderr)
        print(f"error: {cfg.source}: this deployment does not fit: {result.reason}", file=sys.stderr)
        return 2
    engine = LLMEngine(cfg.model, **engine_args(cfg))
    chat_template = None
    if cfg.chat_template is not None:
        try:
            with open(cfg.chat_template, encoding="utf-8") as f:
                chat_template = f.read()
        except OSError as e:
            raise ConfigError(f"{cfg.source}: field 'chat_template': cannot read {cfg.chat_template}: {e}") from None
    server = OpenAIServer(engine, cfg.model_name, cfg.model, max_pending_requests=cfg.max_pending_requests,
                          api_key=cfg.api_key, allowed_local_media_path=cfg.allowed_local_media_path,
                          tool_call_parser=cfg.tool_call_parser, chat_template=chat_template)
    print(f"serving {cfg.model_name!r} on http://{cfg.host}:{cfg.port}/v1", file=sys.stderr, flush=True)
    run_server(server, cfg.host, cfg.port, log_level=args.log_level)
    return 0


def _cmd_align(args) -> int:
    from fastdeploy_ext.entrypoints.align import (
        MissingExtraError,
        plot_statistics,
        require_align_extra,
        run_alignment,
    )

    if not args.threshold > 0:
        print(f"error: --threshold must be > 0, got {args.threshold}", file=sys.stderr)
        return 2
    try:
        require_align_extra(plot=args.plot is not None)
        import transformers

        # The HF MiniMax load report lists the decay buffers it recomputes, which are not in a checkpoint by design.
        transformers.logging.set_verbosity_error()
        result = run_alignment(args.model, args.prompt, args.audio, reference_dir=args.reference,
                               threshold=args.threshold, max_model_len=args.max_model_len)
    except (MissingExtraError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(result.report())
    if args.plot:
        plot_statistics(result.rows, result.threshold, args.plot,
                        f"{result.arch} vs reference ({result.num_tokens} tokens)")
        print(f"wrote {args.plot}")
    return 0 if result.diverging is None else 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fastdeploy-ext", description="MiniMax-M1 and MiDashengLM on a "
                                "FastDeploy-style PaddlePaddle engine.")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="write a tiny random checkpoint (offline) and generate with it")
    d.add_argument("--out", default=os.path.join(os.getcwd(), "tiny_models", "qwen2"),
                   help="where the tiny checkpoint lives (default: ./tiny_models/qwen2)")
    d.set_defaults(func=_cmd_demo)

    from fastdeploy_ext.tiny import tiny_architectures

    m = sub.add_parser("make-tiny", help="write a tiny random checkpoint (config.json + safetensors + tokenizer)")
    m.add_argument("--arch", required=True, choices=tiny_architectures(), help="architectures[0] of the checkpoint")
    m.add_argument("--out", required=True, help="output directory")
    m.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    m.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="on-disk dtype (default float32)")
    m.add_argument("--shards", type=int, default=1, help="number of safetensors shards (>1 writes an index)")
    m.set_defaults(func=_cmd_make_tiny)

    g = sub.add_parser("generate", help="generate from a checkpoint directory")
    g.add_argument("--model", required=True, help="checkpoint directory")
    g.add_argument("--prompt", required=True, action="append", help="prompt text (repeat for several)")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--no-tqdm", action="store_true", help="no progress bar")
    g.set_defaults(func=_cmd_generate)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (configs/*.yaml; flags override the file)")
    _add_deploy_flags(s)
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    s.set_defaults(func=_cmd_serve)

    pl = sub.add_parser("plan", help="per-rank memory plan of a deployment config (exit 1 if it does not fit)")
    _add_deploy_flags(pl)
    pl.add_argument("--gpu-memory", dest="device_memory", help="memory per card, e.g. 80GiB (= --device-memory)")
    pl.add_argument("--length", type=int, default=None, help="sequence length for the largest max_num_seqs "
                    "(default: max_model_len)")
    pl.add_argument("--json", action="store_true", help="print the numbers as JSON")
    pl.set_defaults(func=_cmd_plan)

    a = sub.add_parser(
        "align", formatter_class=argparse.RawDescriptionHelpFormatter,
        help="per-layer hidden states vs the reference implementation (needs the align extra)",
        description="Teacher-force one prompt through this implementation and the reference (CPU, fp32) and print,\n"
        "per row (embed, each decoder layer's output, final norm): mean and std of our hidden state, mean and max\n"
        "|ours - ref|, rel err = ||ours - ref|| / ||ref||, then the first row whose rel err exceeds --threshold.\n\n"
        "References: Qwen2 -> transformers Qwen2ForCausalLM; MiniMax-M1 / MiniMax-Text-01 / HF-native MiniMax ->\n"
        "transformers MiniMaxForCausalLM with its RoPE patched to MiniMax's partial rotation (transformers rotates\n"
        "the whole head; unpatched it would blame every correct full-attention layer); MiDashengLM -> the dasheng\n"
        "encoder + the projector in torch + transformers Qwen2.\n\n"
        'Needs the align extra: pip install -e ".[align]" (plus dasheng==0.0.9 for MiDashengLM).\n'
        "Exit status: 0 no diverging layer, 1 a layer diverges, 2 missing dependency or bad input.")
    a.add_argument("--model", required=True, help="checkpoint directory (our side, and the reference's unless --reference)")
    a.add_argument("--reference", default=None, help="load the reference from this checkpoint instead of --model "
                   "(e.g. the original when --model is a converted copy)")
    a.add_argument("--prompt", required=True, help="prompt text; for MiDashengLM a prompt without <|AUDIO|> gets one "
                   "audio placeholder per --audio in front")
    a.add_argument("--audio", action="append", default=None, help="audio file for MiDashengLM (repeat for several)")
    from fastdeploy_ext.entrypoints.align import DEFAULT_THRESHOLD

    a.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD,
                   help=f"rel err above which a layer diverges (default {DEFAULT_THRESHOLD:g}; fp32 noise is ~1e-6)")
    a.add_argument("--plot", default=None, help="write rel err per layer (log scale) to this PNG")
    a.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt accepted (default: max_position_embeddings, at most 4096)")
    a.set_defaults(func=_cmd_align)
    return p


def main(argv=None) -> int:
    from fastdeploy_ext.config.base import ConfigError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
