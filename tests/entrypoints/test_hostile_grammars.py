"""Hostile structured-output requests against a real ``serve`` subprocess (issue 33): a grammar that crashes
llguidance (a Lark rule chain 3,000 deep overflows its stack), one whose compile runs past the budget (N
``patternProperties``, about O(N^4)), one whose lexemes blow up at the first mask or a later one, and grammars
over llguidance's parser limits at the first token. Each is a 400 (or an error finish) naming the field, the
server stays up and answers ``/health`` within a bounded wait, nothing keeps computing after the refusal,
nothing failed is cached, and valid grammars still give outputs that match them."""

import json
import os
import re
import threading

import httpx
import pytest

MODEL = "tiny"


def chain(depth: int) -> str:
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(depth)) + f'r{depth}: "x"\n'


def pattern_properties(n: int) -> dict:
    return {"type": "object", "patternProperties": {f"^p{i}[a-z]*$": {"type": "string"} for i in range(n)}}


@pytest.fixture(scope="module")
def server(start_server, tiny_qwen2_dir):
    return start_server(["--model", tiny_qwen2_dir, "--served-model-name", MODEL, "--max-model-len", "256",
                         "--guided-compile-timeout-s", "3"])


def server_pid(server) -> int:
    with open(f"/proc/{server.proc.pid}/task/{server.proc.pid}/children") as f:
        return int(f.read().split()[0])


def children(pid: int) -> list[int]:
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(c) for c in f.read().split()]
    return out


def compile_workers(pid: int) -> set[int]:
    found = set()
    for c in children(pid):
        try:
            with open(f"/proc/{c}/cmdline", "rb") as f:
                if b"grammar_worker" in f.read():
                    found.add(c)
        except FileNotFoundError:
            pass
    return found


def threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def completion(server, timeout=60, **body):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 8, "temperature": 1.0, **body}
    return httpx.post(server.url + "/v1/completions", json=body, timeout=timeout)


def healthy(server):
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def still_constrains(server, seed):
    r = completion(server, guided_regex="[a-z]{2}-[0-9]{2}", seed=seed, max_tokens=16)
    assert r.status_code == 200, r.text
    assert re.fullmatch("[a-z]{2}-[0-9]{2}", r.json()["choices"][0]["text"])


def test_rule_chain_that_overflows_llguidances_stack_is_400_and_the_server_lives(server):
    grammar = chain(3000)
    assert len(grammar.encode()) < 64 * 1024
    pid = server_pid(server)
    r = completion(server, guided_grammar=grammar)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "guided_grammar"
    assert "SIGSEGV" in r.json()["error"]["message"]
    assert server.proc.poll() is None and os.path.exists(f"/proc/{pid}")
    healthy(server)
    # not cached as compiled: the same grammar is refused again, not served
    assert completion(server, guided_grammar=grammar).status_code == 400
    # a chain well inside the bound compiles and constrains
    r = completion(server, guided_grammar=chain(500), max_tokens=4)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "x", r.text
    still_constrains(server, 0)


def test_compile_over_its_budget_is_stopped_after_the_400(server):
    pid = server_pid(server)
    # Two requests at once first: the compile workers are up, and the server's thread pools hold the threads
    # two concurrent requests use, so what is counted below is what the killed compiles leave behind.
    warm = [threading.Thread(target=completion, args=(server,), kwargs={"guided_regex": f"[0-{i + 1}]"})
            for i in range(2)]
    for t in warm:
        t.start()
    for t in warm:
        t.join(120)
    before_threads = threads(pid)
    results = []

    def send():
        results.append(completion(server, guided_json=pattern_properties(640)))

    senders = [threading.Thread(target=send) for _ in range(2)]
    for t in senders:
        t.start()
    for t in senders:
        t.join(120)
    assert [r.status_code for r in results] == [400, 400], [r.text for r in results]
    assert all("took longer than 3 s (stopped)" in r.json()["error"]["message"] for r in results)
    # The compiles were killed with their workers: every worker left is idle (sleeping on its pipe), and the
    # server has no more threads than before.
    for w in compile_workers(pid):
        with open(f"/proc/{w}/stat") as f:
            assert f.read().rsplit(")", 1)[1].split()[0] == "S"
    assert threads(pid) <= before_threads + 1
    healthy(server)
    still_constrains(server, 1)


def test_lazy_lexeme_blowup_ends_the_request_with_an_error_not_the_engine(server):
    """X{1000}{1000}: 15 bytes. Its lexer is built at the first mask, in the compile worker: within the budget
    (about 1 s on an idle core) the request is admitted and exceeds llguidance's lexer limit at the next token,
    ending with an error event (400, naming the field); past it (a loaded machine) it is refused before
    admission. Either way the field is named, the engine never stalls on it, and a second request with the
    same grammar meets the same end, never a silent "stop"."""
    ends = []
    for _ in range(2):
        r = completion(server, guided_regex="X{1000}{1000}", stream=True, max_tokens=8)
        if r.status_code == 400:
            assert r.json()["error"]["param"] == "guided_regex"
            assert "took longer than 3 s (stopped)" in r.json()["error"]["message"]
            ends.append("refused")
            continue
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        error = events[-1]["error"]["message"]
        assert events[-1]["error"]["param"] == "guided_regex" and events[-1]["error"]["code"] == 400
        assert "guided decoding" in error and "too many expressions" in error and len(error) < 500, error
        assert r.text.rstrip().endswith("data: [DONE]")
        ends.append("error")
    assert ends[1] == "error" or ends == ["refused", "refused"]  # a compiled grammar stays compiled
    healthy(server)
    still_constrains(server, 2)


@pytest.mark.parametrize("body", [
    {"guided_choice": [f"c{i}" + "y" * 200 for i in range(256)]},
    {"guided_grammar": "start: " + " | ".join(f'"a{i}" b{i}' for i in range(2500)) + "\n"
                       + "".join(f'b{i}: "x"\n' for i in range(2500))},
], ids=["choice-256x200", "2500-alternatives"])
def test_grammars_at_or_over_parser_limits_are_400_or_valid(server, body):
    """Over llguidance's parser limits at the first token or a later one: a 400 naming the field (the client's
    grammar), never a 500; within them, an output of the grammar."""
    field = next(iter(body))
    for stream in (False, True):
        r = completion(server, max_tokens=4, stream=stream, **body)
        if not stream:
            assert r.status_code in (200, 400), r.text
            if r.status_code == 400:
                assert r.json()["error"]["param"] == field
        else:
            errors = [json.loads(line[6:])["error"] for line in r.text.splitlines() if '"error"' in line]
            assert all(e["code"] == 400 and e["param"] == field for e in errors), errors
            assert r.text.rstrip().endswith("data: [DONE]")
    healthy(server)


def test_a_stall_grammar_does_not_hold_other_streams(server):
    """A normal stream keeps producing tokens while a request whose compile runs to the budget is pending."""
    out = {}

    def slow():
        out["slow"] = completion(server, guided_json=pattern_properties(640))

    t = threading.Thread(target=slow)
    t.start()
    r = completion(server, prompt="hello", max_tokens=24, ignore_eos=True)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 24
    t.join(120)
    assert out["slow"].status_code == 400
