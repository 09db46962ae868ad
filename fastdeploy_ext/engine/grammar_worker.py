"""A child process that tries a grammar before the server compiles it: compile plus the first token mask, with
the request's time budget, a memory cap (``RLIMIT_AS``) and a CPU-time backstop (``RLIMIT_CPU``).

llguidance recurses on a grammar's rule references without a depth limit of its own (a Lark chain
``start: r0``, ``r0: r1``, ... about 2,800 deep overflows an 8 MiB stack; none of ``LLParserLimits`` refuses it
first), some grammars compile in O(N^4) (N ``patternProperties``), and lexemes are built lazily, at the first
mask. A crash, a runaway or an over-budget grammar here costs this process only: the parent kills it and
answers 400. The parent then compiles the same grammar itself on a thread with a larger stack
(:data:`PARENT_STACK_BYTES` against :data:`WORKER_STACK_BYTES`), so what passed here cannot overflow there.

Protocol over stdin/stdout: 4-byte little-endian length + a JSON object each way. The first message holds
the tokenizer and the limits; each later one ``{"grammar": text}`` is answered ``{"ok": true}`` or
``{"error": message}``, and ``{"gbnf": text}`` (llguidance's GBNF -> Lark conversion, Python code that recurses
and loops over the rules) ``{"lark": text}`` or ``{"error": message}``. EOF on stdin ends the process.
"""

from __future__ import annotations

import json
import os
import resource
import struct
import sys
import threading

WORKER_STACK_BYTES = 8 << 20
PARENT_STACK_BYTES = 64 << 20


def read_message(stream) -> dict | None:
    head = stream.read(4)
    if len(head) < 4:
        return None
    (size,) = struct.unpack("<I", head)
    data = stream.read(size)
    if len(data) < size:
        return None
    return json.loads(data)


def write_message(stream, message: dict) -> None:
    data = json.dumps(message).encode()
    stream.write(struct.pack("<I", len(data)) + data)
    stream.flush()


def _vm_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))


def _try(tokenizer, grammar: str, limits, vocab_size: int) -> dict:
    import llguidance
    import llguidance.numpy as lln

    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=limits)
    if matcher.is_error():
        return {"error": matcher.get_error()}
    bitmask = lln.allocate_token_bitmask(1, vocab_size)
    lln.fill_next_token_bitmask(matcher, bitmask, 0)
    if matcher.is_error():
        return {"error": matcher.get_error()}
    return {"ok": True}


def main() -> None:
    import llguidance
    import llguidance.gbnf_to_lark  # noqa: F401 (everything imported before the memory cap applies)
    import llguidance.numpy  # noqa: F401

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    setup = read_message(stdin)
    if setup is None:
        return
    tokenizer = llguidance.LLTokenizer(setup["tokenizer_json"], n_vocab=setup["vocab_size"],
                                       eos_token=setup["eos_token_ids"])
    limits = llguidance.LLParserLimits(**setup["limits"])
    # The memory cap applies from here on: the tokenizer and the libraries are in, each grammar gets the budget.
    if setup.get("memory_bytes"):
        cap = _vm_bytes() + setup["memory_bytes"]
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    threading.stack_size(WORKER_STACK_BYTES)
    write_message(stdout, {"ready": True})
    while True:
        request = read_message(stdin)
        if request is None:
            return
        # A CPU-time backstop beyond the parent's wall-clock kill: SIGXCPU ends a compile the parent could not.
        used = resource.getrusage(resource.RUSAGE_SELF)
        spent = used.ru_utime + used.ru_stime
        cpu_cap = int(spent + 2 * request.get("budget_s", 10.0) + 2)
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_cap, resource.RLIM_INFINITY))
        result: dict = {}

        def work():
            try:
                if "gbnf" in request:
                    from llguidance.gbnf_to_lark import gbnf_to_lark

                    result["lark"] = gbnf_to_lark(request["gbnf"])
                else:
                    result.update(_try(tokenizer, request["grammar"], limits, setup["vocab_size"]))
            except RecursionError:
                result["error"] = "nested too deeply"
            except MemoryError:
                result["error"] = "the grammar needs more memory than the compile budget"
            except Exception as e:
                result["error"] = f"{type(e).__name__}: {e}"

        worker = threading.Thread(target=work, name="grammar-try")
        try:
            worker.start()  # its stack counts against the memory cap too
            worker.join()
        except (RuntimeError, MemoryError):
            result["error"] = "the grammar needs more memory than the compile budget"
        write_message(stdout, result or {"error": "no result"})


if __name__ == "__main__":
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    main()
