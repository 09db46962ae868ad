"""The grammar compiler's bounds in-process (issue 33): the compile worker absorbs a crash and a runaway (and is
gone after the refusal), only grammars that compiled and filled their first mask are cached, GBNF is accepted
through the Python API, and the server's log filter lets a flood of one message through once per interval."""

import logging
import os
import re

import pytest

from fastdeploy_ext import LLM, SamplingParams
from fastdeploy_ext.engine.guided_decoding import GrammarError, GuidedDecoder, GuidedDecodingParams
from fastdeploy_ext.entrypoints.limits import RepeatFilter

SQL_GBNF = """root ::= select_statement
select_statement ::= "SELECT " column " from " table
column ::= "col_1 " | "col_2 "
table ::= "table_1 " | "table_2 "
"""


@pytest.fixture(scope="module")
def decoder(tiny_qwen2_dir):
    with open(os.path.join(tiny_qwen2_dir, "tokenizer.json")) as f:
        d = GuidedDecoder(f.read(), 512, [0], compile_timeout_s=3, compile_workers=1)
    yield d
    d.close()


def chain(depth: int) -> str:
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(depth)) + f'r{depth}: "x"\n'


def worker_pids(decoder) -> set[int]:
    return {w.proc.pid for w in decoder.trials._idle}


def test_crash_and_runaway_cost_the_worker_and_leave_nothing_cached(decoder):
    decoder.compile(GuidedDecodingParams(regex="[ab]"))
    assert len(decoder._cache) == 1
    first = worker_pids(decoder)
    with pytest.raises(GrammarError, match="SIGSEGV"):
        decoder.compile(GuidedDecodingParams(grammar=chain(3000)))
    for pid in first:  # the crashed worker is reaped, not left as a zombie
        assert not os.path.exists(f"/proc/{pid}")
    runaway = {"type": "object", "patternProperties": {f"^p{i}[a-z]*$": {"type": "string"} for i in range(640)}}
    with pytest.raises(GrammarError, match=r"longer than 3 s \(stopped\)"):
        decoder.compile(GuidedDecodingParams(json=runaway))
    assert decoder.trials.killed == 2 and worker_pids(decoder) == set()
    assert len(decoder._cache) == 1  # neither failure was cached
    decoder.compile(GuidedDecodingParams(regex="[cd]"))  # a fresh worker
    assert len(decoder._cache) == 2


def test_memory_budget_refuses_in_the_worker(tiny_qwen2_dir):
    with open(os.path.join(tiny_qwen2_dir, "tokenizer.json")) as f:
        small = GuidedDecoder(f.read(), 512, [0], compile_memory_bytes=24 << 20, compile_workers=1)
    try:
        small.compile(GuidedDecodingParams(regex="[a-z]{3}"))
        wide = {"type": "object", "properties": {f"k{i}": {"type": "string"} for i in range(300)}}
        with pytest.raises(GrammarError, match="over the compile memory budget"):
            small.compile(GuidedDecodingParams(json=wide))
        assert len(small._cache) == 1
        small.compile(GuidedDecodingParams(regex="[0-9]{2}"))  # a fresh worker under the same cap
    finally:
        small.close()


def test_gbnf_through_the_python_api(tiny_qwen2_dir):
    llm = LLM(model=tiny_qwen2_dir, max_model_len=256)
    outs = llm.generate(["q"] * 4, [SamplingParams(temperature=1.0, seed=s, max_tokens=32,
                                                   guided_decoding=GuidedDecodingParams(grammar=SQL_GBNF))
                                    for s in range(4)], use_tqdm=False)
    for out in outs:
        assert re.fullmatch(r"SELECT (col_1 |col_2 ) from (table_1 |table_2 )", out.outputs.text), out.outputs.text
    with pytest.raises(ValueError, match="not a Lark or GBNF grammar"):
        llm.generate(["q"], SamplingParams(guided_decoding=GuidedDecodingParams(grammar="root ::= missing")),
                     use_tqdm=False)
    llm.llm_engine.shutdown()


def test_repeat_filter_lets_one_of_a_flood_through_then_counts():
    logger = logging.getLogger("test_repeat_filter")
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logger.addHandler(Keep())
    logger.propagate = False
    f = RepeatFilter(every_s=3600)
    logger.addFilter(f)
    for _ in range(10_000):
        logger.error("socket.accept() out of system resource")
    logger.error("another message")
    assert records == ["socket.accept() out of system resource", "another message"]
    f._seen[next(k for k in f._seen if "accept" in k[1])][0] -= 3600  # the interval has passed
    logger.error("socket.accept() out of system resource")
    assert records[-1] == "socket.accept() out of system resource (and 9999 more like it in the last 3600 s)"
