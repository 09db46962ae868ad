"""The command line as a user meets it: mistakes are one ``error:`` line and exit status 2, found before any
weight is read; help says what each option does, its default and its choices; Paddle's start-up noise is gone.

The mistakes are made against a checkpoint whose safetensors file is garbage: had the CLI loaded the model
first, the error would be about that file instead."""

import os
import re
import socket
import subprocess
import sys

import pytest

from fastdeploy_ext.entrypoints.cli import build_parser
from fastdeploy_ext.tiny import write_tiny

# Subprocesses here carry their own bounds (up to 300 s for a generate on a busy box): each test gets the largest.
pytestmark = pytest.mark.timeout(330)

# What Paddle prints unasked: the ccache warning, glog INFO lines, init_parallel_env's flags banner.
NOISE = re.compile(r"No ccache found|^[IW]\d{4} \d\d:\d\d:\d\d|Modified FLAGS detected", re.M)


def run_cli(*args, cwd=None, timeout=120):
    # The CLI must silence glog itself: the suite's own GLOG_minloglevel is not passed on.
    env = {k: v for k, v in os.environ.items() if k != "GLOG_minloglevel"}
    cmd = ["timeout", str(timeout), sys.executable, "-m", "fastdeploy_ext.entrypoints.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout + 10)


def assert_user_error(r, needle: str) -> None:
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2, r.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert needle in lines[0], lines[0]
    assert "Traceback" not in r.stderr and r.stdout == ""


@pytest.fixture(scope="module")
def unreadable_ckpt(tmp_path_factory):
    """A tiny Qwen2 checkpoint whose config and tokenizer are fine and whose weights cannot be read."""
    d = str(tmp_path_factory.mktemp("unreadable"))
    write_tiny("Qwen2ForCausalLM", d, seed=0)
    with open(os.path.join(d, "model.safetensors"), "wb") as f:
        f.write(b"\xff" * 64)
    return d


GENERATE_MISTAKES = {
    "negative_temperature": (["--prompt", "hi", "--temperature", "-1"], "--temperature: must be >= 0"),
    "prompt_over_max_model_len": (["--prompt", "hello world " * 20, "--max-model-len", "16"],
                                  "--max-model-len is 16"),
    "empty_prompt": (["--prompt", ""], "--prompt is empty"),
    "second_prompt_empty": (["--prompt", "hi", "--prompt", ""], "--prompt #2 is empty"),
    "zero_max_tokens": (["--prompt", "hi", "--max-tokens", "0"], "argument --max-tokens: must be >= 1"),
    "not_a_number": (["--prompt", "hi", "--temperature", "warm"], "invalid float value: 'warm'"),
    "unknown_flag": (["--prompt", "hi", "--temprature", "1"],
                     "unrecognized argument: --temprature; did you mean --temperature?"),
    "bad_choice": (["--prompt", "hi", "--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
    "top_p_above_one": (["--prompt", "hi", "--top-p", "1.5"], "--top-p: must be in [0, 1]"),
    "bf16_on_cpu": (["--prompt", "hi", "--dtype", "bfloat16", "--device", "cpu"],
                    "Paddle on CPU computes in float32 and float64"),
    "tp_not_dividing": (["--prompt", "hi", "--tensor-parallel-size", "3"], "not divisible by 3"),
    "audio_for_text_model": (["--prompt", "hi", "--audio", "clip.wav"], "--audio: Qwen2ForCausalLM takes text only"),
}


@pytest.mark.parametrize("name", list(GENERATE_MISTAKES))
def test_generate_mistakes_are_one_line_before_loading(name, unreadable_ckpt):
    args, needle = GENERATE_MISTAKES[name]
    assert_user_error(run_cli("generate", "--model", unreadable_ckpt, *args), needle)


def test_the_unreadable_checkpoint_is_reached_once_the_settings_are_fine(unreadable_ckpt):
    """The control of the test above: with valid settings the same command reaches the weights and fails there,
    still as one line."""
    r = run_cli("generate", "--model", unreadable_ckpt, "--prompt", "hi", "--quantization", "wint4")
    assert_user_error(r, "checkpoint file is unreadable or truncated")


def test_generate_on_a_directory_without_a_checkpoint(tmp_path):
    assert_user_error(run_cli("generate", "--model", str(tmp_path), "--prompt", "hi"), "no config.json there")


def test_midashenglm_audio_mistakes_before_loading(tmp_path):
    d = str(tmp_path / "midashenglm")
    write_tiny("MiDashengLMModel", d, seed=0)
    with open(os.path.join(d, "model.safetensors"), "wb") as f:
        f.write(b"\xff" * 64)
    assert_user_error(run_cli("generate", "--model", d, "--prompt", "hi", "--audio", str(tmp_path / "none.wav")),
                      "audio file not found")
    assert_user_error(run_cli("generate", "--model", d, "--prompt", "two <|AUDIO|> <|AUDIO|>"),
                      "has 2 <|AUDIO|> placeholder(s) but 0 audio clip(s)")


def test_serve_reports_a_busy_port_before_loading(unreadable_ckpt):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = run_cli("serve", "--model", unreadable_ckpt, "--port", str(port))
    assert_user_error(r, f"cannot listen on 127.0.0.1:{port}")


def test_serve_and_plan_settings_errors(unreadable_ckpt):
    assert_user_error(run_cli("serve", "--model", unreadable_ckpt, "--port", "0", "--max-num-seqs", "0"),
                      "field 'max_num_seqs' must be >= 1, got 0")
    assert_user_error(run_cli("serve"), "give --config FILE or --model DIR")
    assert_user_error(run_cli("plan", "--model", unreadable_ckpt, "--port", "1"), "unrecognized argument: --port")
    assert_user_error(run_cli("serve", "--config", "missing.yaml"), "config file not found: missing.yaml")


def test_make_tiny_refuses_a_directory_holding_something_else(tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    assert_user_error(run_cli("make-tiny", "--arch", "Qwen2ForCausalLM", "--out", str(other)),
                      "is not empty and does not hold a tiny Qwen2ForCausalLM checkpoint")
    assert_user_error(run_cli("demo", "--out", str(other)), "pass --force")
    assert sorted(os.listdir(other)) == ["notes.txt"]

    r = run_cli("make-tiny", "--arch", "Qwen2ForCausalLM", "--out", str(other), "--force")
    assert r.returncode == 0 and (other / "notes.txt").read_text() == "mine" and (other / "config.json").exists()
    # Its own checkpoint may be rewritten (another seed); a different architecture is something else.
    assert run_cli("make-tiny", "--arch", "Qwen2ForCausalLM", "--out", str(other), "--seed", "1").returncode == 0
    assert_user_error(run_cli("make-tiny", "--arch", "MiniMaxM1ForCausalLM", "--out", str(other)),
                      "does not hold a tiny MiniMaxM1ForCausalLM checkpoint")


def test_sharded_rewrite_leaves_no_stale_shards(tmp_path):
    d = str(tmp_path / "ckpt")
    assert run_cli("make-tiny", "--arch", "Qwen2ForCausalLM", "--out", d, "--shards", "3").returncode == 0
    assert run_cli("make-tiny", "--arch", "Qwen2ForCausalLM", "--out", d).returncode == 0
    assert sorted(f for f in os.listdir(d) if "safetensors" in f) == ["model.safetensors"]


def test_bare_command_prints_help_and_version():
    r = run_cli()
    assert r.returncode == 0 and r.stderr == ""
    for command in ("demo", "make-tiny", "generate", "serve", "plan", "align"):
        assert f"    {command}" in r.stdout
    r = run_cli("--version")
    assert r.returncode == 0 and re.fullmatch(r"fastdeploy-ext \d+\.\d+\.\d+ \(paddlepaddle [^,]+, Python \S+\)\n",
                                              r.stdout)


def _subparsers():
    return build_parser()._subparsers._group_actions[0].choices


@pytest.mark.parametrize("command", ["demo", "make-tiny", "generate", "serve", "plan", "align"])
def test_every_option_has_a_sentence_and_its_default(command):
    sub = _subparsers()[command]
    for action in sub._actions:
        if not action.option_strings or action.dest == "help":
            continue
        assert action.help and len(action.help.split()) >= 4, f"{command} {action.option_strings}: {action.help!r}"
    formatter = sub._get_formatter()
    for action in sub._actions:
        if action.option_strings and action.default not in (None, False) and action.dest != "help":
            shown = formatter._expand_help(action)
            assert "default" in shown, f"{command} {action.option_strings[-1]}: no default in {shown!r}"


def test_choices_are_listed_in_help():
    sub = _subparsers()
    generate, serve = sub["generate"].format_help(), sub["serve"].format_help()
    for text in (generate, serve):
        assert "--dtype {auto,float32,float64,bfloat16,float16}" in text
        assert "--quantization {wint8,wint4}" in text
        assert "--backend {auto,host,device}" in text
    assert "--device {auto,cpu,gpu}" in generate and "--device {cpu,gpu}" in serve
    # The deployment defaults the flags fall back to (the flags themselves default to "not given").
    assert "Most sequences in the running batch (default: 64)." in " ".join(serve.split())


def test_plan_help_lists_no_server_flags():
    from fastdeploy_ext.entrypoints.deploy_config import FIELDS, PLAN_FIELDS

    sub = _subparsers()
    plan, serve = sub["plan"].format_help(), sub["serve"].format_help()
    flags = ["--" + name.replace("_", "-") for name in FIELDS if name not in PLAN_FIELDS] + ["--log-level"]
    assert {"--host", "--port", "--api-key", "--reasoning-parser", "--seed", "--stats-interval"} <= set(flags)
    for flag in flags:
        assert re.search(re.escape(flag) + r"\b", serve), flag
        assert not re.search(re.escape(flag) + r"[\s,=]", plan), flag


def test_generate_runs_without_paddle_noise(tmp_path):
    d = str(tmp_path / "tiny")
    assert run_cli("make-tiny", "--arch", "Qwen2ForCausalLM", "--out", d).returncode == 0
    r = run_cli("generate", "--model", d, "--prompt", "hello", "--max-tokens", "4", "--no-tqdm")
    assert r.returncode == 0, r.stderr
    assert "finish_reason=" in r.stdout and not NOISE.search(r.stderr) and r.stderr == ""


def test_rank_logs_carry_no_paddle_noise(tiny_qwen2_dir, monkeypatch):
    """Rank processes silence Paddle themselves, whatever the driver's environment."""
    from fastdeploy_ext import LLM, SamplingParams

    monkeypatch.delenv("GLOG_minloglevel", raising=False)
    with LLM(model=tiny_qwen2_dir, tensor_parallel_size=2, max_model_len=64) as llm:
        assert len(llm.generate("hi", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs.token_ids) == 2
        log_dir = llm.llm_engine.runner.log_dir
        logs = [open(os.path.join(log_dir, f"workerlog.{r}")).read() for r in range(2)]
    for log in logs:
        assert "rank " in log and not NOISE.search(log), log


def test_generate_takes_the_prefix_caching_switch(tmp_path):
    from fastdeploy_ext.entrypoints.cli import _engine_kwargs

    d = str(tmp_path / "tiny")
    assert run_cli("make-tiny", "--arch", "MiniMaxM1ForCausalLM", "--out", d).returncode == 0
    shared = "the music of the day " * 12
    args = ["generate", "--model", d, "--prompt", shared + "one", "--prompt", shared + "two", "--max-tokens", "4",
            "--no-tqdm"]
    for flag, want in (([], None), (["--enable-prefix-caching"], True), (["--no-enable-prefix-caching"], False)):
        assert _engine_kwargs(build_parser().parse_args(args + flag))["enable_prefix_caching"] is want
    on, off = run_cli(*args, "--enable-prefix-caching"), run_cli(*args, "--no-enable-prefix-caching")
    assert on.returncode == 0 and off.returncode == 0, on.stderr + off.stderr
    assert on.stdout.count("finish_reason=") == 2 and on.stdout == off.stdout


# ---- an operator's first hour (issue 29)


def test_abbreviated_flags_are_refused(tiny_qwen2_dir):
    """argparse would take --max-token as --max-tokens; here it is an unknown flag, named, with the right one."""
    r = run_cli("generate", "--model", tiny_qwen2_dir, "--prompt", "hi", "--max-token", "5")
    assert_user_error(r, "unrecognized argument: --max-token; did you mean --max-tokens?")


def test_an_unknown_flag_is_named_before_a_missing_required_one(tiny_qwen2_dir):
    r = run_cli("generate", "--model", tiny_qwen2_dir, "--promt", "hi")
    assert_user_error(r, "unrecognized argument: --promt; did you mean --prompt?")


def test_plan_json_into_a_closed_pipe_ends_quietly():
    configs = os.path.join(os.path.dirname(__file__), "..", "..", "configs")
    cmd = (f"timeout 120 {sys.executable} -m fastdeploy_ext.entrypoints.cli plan --config "
           f"{configs}/minimax-m1-80k-tp8-bf16-h200.yaml --json | head -n 1; exit ${{PIPESTATUS[0]}}")
    r = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=150)
    assert r.returncode == 0 and r.stdout == "{\n", (r.stdout, r.stderr)
    assert r.stderr == "", r.stderr


@pytest.mark.parametrize("command", ["generate", "serve", "plan"])
def test_a_wrong_model_path_is_reported_before_paddle_is_imported(tmp_path, command):
    missing = str(tmp_path / "no-such-model")
    args = ["--model", missing] + (["--prompt", "hi"] if command == "generate" else [])
    code = ("import sys; from fastdeploy_ext.entrypoints.cli import main; rc = main(sys.argv[1:]); "
            "print('paddle imported' if 'paddle' in sys.modules else 'paddle not imported'); sys.exit(rc)")
    r = subprocess.run(["timeout", "120", sys.executable, "-c", code, command, *args], capture_output=True,
                       text=True, timeout=130)
    assert r.returncode == 2 and r.stdout.strip() == "paddle not imported", (r.stdout, r.stderr)
    assert r.stderr.strip() == f"error: --model {missing}: no such directory"


def test_triton_kernels_without_triton_name_the_extra(tmp_path):
    d = str(tmp_path / "m1")
    write_tiny("MiniMaxM1ForCausalLM", d, seed=0)
    code = ("import sys; sys.modules['triton'] = None; from fastdeploy_ext.entrypoints.cli import main; "
            "sys.exit(main(sys.argv[1:]))")
    env = {**os.environ, "FDEXT_LIGHTNING_KERNELS": "triton"}
    r = subprocess.run(["timeout", "300", sys.executable, "-c", code, "generate", "--model", d, "--prompt", "hi",
                        "--backend", "device", "--max-tokens", "2", "--no-tqdm"], capture_output=True, text=True,
                       env=env, timeout=310)
    assert_user_error(r, 'FDEXT_LIGHTNING_KERNELS=triton needs Triton, which is not installed: '
                         'pip install -e ".[triton]"')


def test_ctrl_c_on_generate_prints_what_finished(tiny_qwen2_dir):
    """SIGINT after the first request finished: its output is printed, the rest are reported unfinished."""
    # One sequence at a time; the engine step after the first request finished is interrupted.
    script = (
        "import os, signal, sys\n"
        "from fastdeploy_ext.entrypoints.cli import main\n"
        "from fastdeploy_ext.engine import llm as llm_mod\n"
        "real, seen = llm_mod.LLMEngine.step, []\n"
        "def step(self):\n"
        "    if seen:\n"
        "        os.kill(os.getpid(), signal.SIGINT)\n"
        "    out = real(self)\n"
        "    seen.extend(r for r in out if r.finished)\n"
        "    return out\n"
        "llm_mod.LLMEngine.step = step\n"
        "sys.exit(main(sys.argv[1:]))\n")
    r = subprocess.run(["timeout", "300", sys.executable, "-c", script, "generate", "--model", tiny_qwen2_dir,
                        "--prompt", "a", "--prompt", "b c d e f", "--max-tokens", "2", "--max-num-seqs", "1",
                        "--no-tqdm"], capture_output=True, text=True, timeout=310)
    assert r.returncode == 130, r.stderr
    assert "Traceback" not in r.stderr and "KeyboardInterrupt" not in r.stderr
    assert r.stdout.count("--- request ") == 1 and "prompt:     'a'" in r.stdout
    assert r.stderr.strip().splitlines()[-1] == "interrupted: 1 of 2 request(s) had finished (printed above)"


def test_llm_warm_up_says_what_it_does(tiny_qwen2_dir, caplog):
    """The CPU warm-up takes seconds: it is logged (and shown on a terminal when logging is quiet)."""
    import logging

    from fastdeploy_ext import LLM

    with caplog.at_level(logging.INFO, logger="fastdeploy_ext"):
        with LLM(model=tiny_qwen2_dir, max_model_len=64, max_num_seqs=2):
            pass
    assert any(r.getMessage().startswith("warming up: one dummy prefill") for r in caplog.records)


def test_a_failed_tensor_parallel_rank_is_one_line_with_its_own_error(tiny_qwen2_dir, tmp_path):
    """Rank 1 fails while building its shard (a fault injected into that rank process only): the CLI prints
    one error line carrying the rank's own error and log tail, not the driver's chained traceback."""
    (tmp_path / "sitecustomize.py").write_text(
        "import os, sys\n"
        "if os.environ.get('FDEXT_SPAWNED_RANK') and sys.argv[-2:] == ['--rank', '1']:\n"
        "    from fastdeploy_ext.engine import engine\n"
        "    def build_model(*a, **k):\n"
        "        print('rank 1: cannot allocate the shard (injected)', flush=True)\n"
        "        raise MemoryError('injected: out of device memory')\n"
        "    engine.build_model = build_model\n")
    env = {k: v for k, v in os.environ.items() if k != "GLOG_minloglevel"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    r = subprocess.run(["timeout", "300", sys.executable, "-m", "fastdeploy_ext.entrypoints.cli", "generate",
                        "--model", tiny_qwen2_dir, "--prompt", "hi", "--tensor-parallel-size", "2", "--no-tqdm"],
                       capture_output=True, text=True, env=env, timeout=310)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    # the rank's exit may be seen first (heartbeat) or its report: both name rank 1 and carry its own error
    assert lines[0].startswith("error: tensor-parallel rank 1 ") and "during startup" in lines[0], lines
    assert "MemoryError: injected: out of device memory" in lines[0]
    assert "its log ends:" in lines[0] and "(log: " in lines[0] and "Traceback" not in r.stderr
