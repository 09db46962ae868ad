"""Every fenced block in README.md and docs/ either runs here or says why not.

A block runs when it is ``python`` or a shell block (``bash``/``sh``) whose commands are ``fastdeploy-ext ...`` or
``python ...``; otherwise the line before its fence must be ``<!-- no-run: reason -->``. An unmarked block that
cannot run, and a run block that fails, fail the test. Blocks run in order, one file after another, in one scratch
directory (``configs/`` linked in, one tiny Qwen2 checkpoint shared), so a block may use what an earlier block of
its file wrote. A shell line ending in ``# exit N`` must exit with status N. ``fastdeploy-ext serve`` gets a free
port, runs in the background until its file is done (``127.0.0.1:8000`` in the file's later blocks becomes that
port) and is stopped; every process runs under ``timeout``.
"""

import glob
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "**", "*.md"),
                                                                          recursive=True))
NO_RUN = re.compile(r"^<!--\s*no-run:\s*(?P<reason>\S.*?)\s*-->$")
FENCE = re.compile(r"^(?P<fence>```+|~~~+)\s*(?P<lang>[\w+-]*)")
SHELL = ("bash", "sh", "shell")
COMMANDS = ("fastdeploy-ext", "python", "python3")
SUBCOMMANDS = ("demo", "make-tiny", "generate", "serve", "plan", "align")
BLOCK_TIMEOUT_S = 300


@dataclass
class Block:
    path: str
    line: int
    lang: str
    text: str
    no_run: str | None

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def blocks_of(path: str) -> list:
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        lines = f.read().split("\n")
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith(m["fence"])), None)
        assert end is not None, f"{path}:{i + 1}: unclosed code fence"
        prev = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = NO_RUN.match(prev)
        out.append(Block(path, i + 1, m["lang"], "\n".join(lines[i + 1:end]), marker["reason"] if marker else None))
        i = end + 1
    return out


def indented_code_blocks(path: str) -> list:
    """Lines that open a Markdown indented code block (4 spaces after a blank line, outside a list): such blocks
    escape the fenced-block rule, so they are not allowed."""
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        lines = f.read().split("\n")
    found, in_fence = [], False
    for i, line in enumerate(lines):
        if FENCE.match(line):
            in_fence = not in_fence
        if in_fence or i == 0 or lines[i - 1].strip() or not line.startswith("    ") or not line.strip():
            continue
        prev = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        if not re.match(r"^(\s+|[-*+] |\d+\. )", prev):
            found.append(i + 1)
    return found


def shell_commands(text: str) -> list:
    """Commands of a shell block: backslash continuations and quoted newlines (``python -c '...'``) joined, blank
    and comment lines dropped."""
    commands, pending = [], ""
    for line in re.sub(r"\\\n\s*", " ", text).split("\n"):
        pending = f"{pending}\n{line}" if pending else line
        try:
            shlex.split(pending, comments=True)
        except ValueError:  # an open quote: the command goes on
            continue
        if pending.strip() and not pending.strip().startswith("#"):
            commands.append(pending.strip())
        pending = ""
    assert not pending, f"unclosed quote in {text!r}"
    return commands


def runnable(block: Block) -> bool:
    if block.lang == "python":
        return True
    return block.lang in SHELL and all(shlex.split(c, comments=True)[0] in COMMANDS for c in shell_commands(block.text))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Scratch:
    """The working directory of the blocks and the servers they started."""

    def __init__(self, path: str):
        self.path = path
        self.servers = []  # (process, log file, port)
        self.file = None  # the document whose blocks ran last
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH"))
                                                               if p)}

    def run(self, argv: list, what: str) -> tuple:
        r = subprocess.run(["timeout", str(BLOCK_TIMEOUT_S), *argv], cwd=self.path, env=self.env, text=True,
                           capture_output=True, timeout=BLOCK_TIMEOUT_S + 30)
        return r, f"{what}: exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"

    def command(self, line: str, where: str) -> str | None:
        expected = 0
        m = re.search(r"#\s*exit\s+(\d+)\s*$", line)
        if m:
            expected, line = int(m.group(1)), line[:m.start()].strip()
        argv = shlex.split(line, comments=True)
        if argv[0] == "fastdeploy-ext" and len(argv) > 1 and argv[1] == "serve":
            return self.start_server(argv, where)
        r, report = self.run(["bash", "-c", line], f"{where}: `{line}`")
        return None if r.returncode == expected else report

    def start_server(self, argv: list, where: str) -> str | None:
        port = _free_port()
        log = open(os.path.join(self.path, f"server-{port}.log"), "w")
        proc = subprocess.Popen(["timeout", str(BLOCK_TIMEOUT_S * 2), *argv, "--port", str(port)], cwd=self.path,
                                env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.servers.append((proc, log, port))
        deadline = time.monotonic() + 100
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    return None
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        with open(log.name) as f:
            return f"{where}: `{shlex.join(argv)}` did not become healthy (exit {proc.poll()}):\n{f.read()[-3000:]}"

    def python(self, block: Block, n: int) -> str | None:
        source = block.text
        for _, _, port in self.servers:
            source = source.replace("127.0.0.1:8000", f"127.0.0.1:{port}")
        script = os.path.join(self.path, f"block_{os.path.basename(block.path)}_{n}.py")
        with open(script, "w", encoding="utf-8") as f:
            f.write(source)
        r, report = self.run([sys.executable, script], block.where)
        return None if r.returncode == 0 else report

    def stop_servers(self) -> None:
        for proc, log, _ in self.servers:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
            log.close()
        self.servers.clear()


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    from fastdeploy_ext.tiny import write_tiny

    path = str(tmp_path_factory.mktemp("docs"))
    os.symlink(os.path.join(ROOT, "configs"), os.path.join(path, "configs"))
    write_tiny("Qwen2ForCausalLM", os.path.join(path, "tiny_models", "qwen2"), seed=0)
    s = Scratch(path)
    yield s
    s.stop_servers()


@pytest.mark.parametrize("path", DOCS)
def test_every_block_runs_or_says_why_not(path):
    problems = [f"{path}:{n}: indented code block; fence it (```bash, ```python, or ``` with a no-run marker)"
                for n in indented_code_blocks(path)]
    problems += [f"{b.where}: a ```{b.lang} block that is not run: make it runnable or put `<!-- no-run: reason -->` "
                 "on the line before it" for b in blocks_of(path) if b.no_run is None and not runnable(b)]
    assert not problems, "\n".join(problems)


# One test per block that runs, in file order (a block may use what the earlier ones of its file left).
RUN = [(path, n) for path in DOCS for n, b in enumerate(blocks_of(path)) if b.no_run is None and runnable(b)]


@pytest.mark.parametrize("path,n", RUN, ids=[f"{p}:{blocks_of(p)[n].line}" for p, n in RUN])
def test_block_runs(path, n, scratch):
    if scratch.file != path:
        scratch.stop_servers()  # a file's servers serve its own later blocks only
        scratch.file = path
    block = blocks_of(path)[n]
    if block.lang == "python":
        problems = [scratch.python(block, n)]
    else:
        problems = [scratch.command(line, block.where) for line in shell_commands(block.text)]
    problems = [p for p in problems if p]
    assert not problems, "\n\n".join(problems)


def test_the_readme_and_every_subcommand_have_blocks_that_run():
    run = [b for path in DOCS for b in blocks_of(path) if b.no_run is None and runnable(b)]
    for sub in SUBCOMMANDS:
        assert any(b.lang in SHELL and re.search(rf"(^|\n)\s*fastdeploy-ext {sub}\b", b.text) for b in run), sub
    readme = blocks_of("README.md")
    assert all(b.no_run is None for b in readme if b.lang == "python")
    assert any(b.no_run is None and "fastdeploy-ext demo" in b.text for b in readme)


def test_the_rules_catch_what_they_should(tmp_path):
    """An unmarked output block is not runnable, a marked one is skipped, an indented block is found."""
    doc = tmp_path / "doc.md"
    doc.write_text("text\n\n```\n$ output\n```\n\n<!-- no-run: output of the above -->\n```\nmore\n```\n\n"
                   "```bash\nfastdeploy-ext plan --config x.yaml  # exit 1\ncp a b\n```\n\nprose\n\n    indented\n")
    blocks = blocks_of(str(doc))
    assert [b.no_run for b in blocks] == [None, "output of the above", None]
    assert not runnable(blocks[0]) and not runnable(blocks[2])
    assert indented_code_blocks(str(doc)) == [19]


# Repository paths as the docs write them: from the root, or inside the package (`ops/host/moe.py`).
REPO_PATH = re.compile(r"(?<![\w/.-])((?:fastdeploy_ext|tests|docs|benchmarks|specs|ops|layers|models|engine|entrypoints|"
                       r"quantization|config|tiny)/[\w./-]*\w)")
ISSUE = re.compile(r"\b[Ii]ssue #?\d+\b|\b[Ii]ssues #\d+")


@pytest.mark.parametrize("path", DOCS)
def test_docs_cite_only_what_the_repository_holds(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        text = f.read()
    missing = sorted({p for p in REPO_PATH.findall(text)
                      if not any(os.path.exists(os.path.join(ROOT, base, p)) for base in ("", "fastdeploy_ext"))})
    assert not missing, f"{path} cites paths the repository does not hold: {missing}"
    assert not ISSUE.findall(text), f"{path} cites issue numbers, which are not in the repository"


# ---- pasted outputs are checked against what the code prints


def _plan(*args) -> str:
    r = subprocess.run(["timeout", "120", sys.executable, "-m", "fastdeploy_ext.entrypoints.cli", "plan", *args],
                       cwd=ROOT, capture_output=True, text=True, timeout=150)
    assert r.returncode in (0, 1), r.stderr
    return r.stdout


def _output_block(path: str, needle: str) -> str:
    found = [b for b in blocks_of(path) if b.no_run is not None and needle in b.text]
    assert len(found) == 1, f"{path}: {len(found)} output blocks hold {needle!r}"
    return found[0].text


def test_pasted_plan_outputs_are_what_plan_prints():
    text = _output_block("docs/deployment.md", "== minimax-m1-80k-tp8-bf16-h200")
    sections = re.split(r"(?m)^== (\S+)\n", text)[1:]
    assert len(sections) >= 8
    for name, pasted in zip(sections[::2], sections[1::2]):
        assert _plan("--config", f"configs/{name}.yaml").strip() == pasted.strip(), name
    tail = _output_block("docs/deployment.md", "DOES NOT FIT").strip()
    printed = _plan("--config", "configs/minimax-m1-80k-tp8-bf16-h200.yaml", "--gpu-memory", "80GB").strip()
    assert printed.endswith(tail), printed


def test_the_status_line_example_is_what_the_server_logs():
    from fastdeploy_ext.entrypoints.openai_server import EngineStats, stats_line

    stats = EngineStats(running=8, waiting=0, kv_blocks_used=412, kv_blocks_cached=96, kv_blocks_total=4096,
                        state_slots_used=8, state_slots_total=16, prefix_cache_query_tokens_total=51212,
                        prefix_cache_hit_tokens_total=36514)
    line = stats_line(stats, pending=8, prompt_rate=1204.5, generation_rate=151.2)
    assert _output_block("docs/deployment.md", "blocks in use").strip() == line
