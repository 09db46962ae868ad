"""Chat-template rendering with bounded cost.

:func:`make_environment` is the one Jinja environment chat templates run in (the served template in-process,
client templates in workers): transformers' ``ImmutableSandboxedEnvironment`` (no attribute escapes) that also
caps what one expression may build (string/list repetition and concatenation, padding methods and filters) and
the rendered output, so ``{{ 'ab ' * 10000000 }}`` fails at once instead of allocating gigabytes.

A client-supplied template (``--trust-request-chat-template``) can still loop for ever, so it renders in a
:class:`TemplateWorkers` process: JSON in and out over pipes (nothing is unpickled), an address-space limit,
and SIGKILL once ``timeout_s`` has passed. This module imports only the standard library and jinja2, so a worker
starts without Paddle.
"""

from __future__ import annotations

import json
import re
import select
import subprocess
import sys
import threading
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.sandbox

# Longest string or list one template expression may produce (characters or items).
MAX_VALUE_LEN = 1 << 20
# A worker's address-space limit: jinja2 needs ~60 MB; anything past this is a MemoryError in the worker.
WORKER_MEMORY_BYTES = 1 << 30
# Template variables owned by request fields; chat_template_kwargs cannot set them.
RESERVED_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt"})


class TemplateLimitError(jinja2.exceptions.SecurityError):
    """A template tried to build a value or an output past the sandbox's caps."""


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson HTML-escapes '<' and '&', which would corrupt tool schemas in prompts.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


def _sized(value):
    return isinstance(value, (str, bytes, list, tuple))


def _check_len(n: int, what: str) -> None:
    if n > MAX_VALUE_LEN:
        raise TemplateLimitError(f"chat template: {what} would have {n} elements (limit {MAX_VALUE_LEN})")


_PADDING_METHODS = {"center", "ljust", "rjust", "zfill", "expandtabs"}
# A printf field's width and precision (``%-099.99d``, ``%*.*f``).
_PRINTF_FIELD = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")


def _check_printf(fmt: str, args) -> None:
    """Refuse ``fmt % args`` whose fields' widths and precisions add up past MAX_VALUE_LEN, before formatting."""
    star = iter(a for a in (args if isinstance(args, tuple) else (args,)) if isinstance(a, int))
    total = 0
    for m in _PRINTF_FIELD.finditer(fmt):
        for size in m.groups():
            total += abs(next(star, 0)) if size == "*" else int(size) if size else 0
            _check_len(total, "a %-formatted string")


class _CappedSandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    # An intercepted operator is also never constant-folded while the template is parsed (jinja's BinExpr.as_const),
    # so `{{ '%99999999d' % 1 }}` costs nothing in the server that parses a client template; it is refused when
    # it would run.
    intercepted_binops = frozenset({"*", "+", "**", "%"})

    def call_binop(self, context, operator, left, right):
        if operator == "*":
            for seq, times in ((left, right), (right, left)):
                if _sized(seq) and isinstance(times, int):
                    _check_len(len(seq) * max(times, 0), "a repeated value")
        elif operator == "+" and _sized(left) and _sized(right):
            _check_len(len(left) + len(right), "a concatenation")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(right) > 64:
            raise TemplateLimitError(f"chat template: exponent {right} is too large")
        elif operator == "%" and isinstance(left, str):
            _check_printf(left, right)
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's signature)
        name = getattr(__obj, "__name__", "")
        if isinstance(getattr(__obj, "__self__", None), str) and name in _PADDING_METHODS:
            widths = [a for a in (*args, *kwargs.values()) if isinstance(a, int)]
            if widths:
                _check_len(max(widths) * (8 if name == "expandtabs" else 1), f"str.{name}")
        result = super().call(__context, __obj, *args, **kwargs)
        if _sized(result):
            _check_len(len(result), f"the result of {name or 'a call'}")
        return result


def _capped_filter(fn, width_arg: int):
    def filt(*args, **kwargs):
        width = args[width_arg] if len(args) > width_arg else kwargs.get("width")
        if isinstance(width, int):
            _check_len(width, f"filter {fn.__name__}")
        result = fn(*args, **kwargs)
        if _sized(result):
            _check_len(len(result), f"filter {fn.__name__}")
        return result

    return filt


def make_environment() -> jinja2.Environment:
    """The sandboxed environment of every chat template (transformers' settings plus the growth caps)."""
    env = _CappedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    for name, width_arg in (("center", 1), ("indent", 1), ("wordwrap", 2), ("truncate", 2), ("replace", 3),
                            ("join", 2), ("format", 1)):
        env.filters[name] = _capped_filter(env.filters[name], width_arg)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENV = make_environment()


def compile_template(source: str) -> jinja2.Template:
    return _ENV.from_string(source)


def undeclared_variables(source: str) -> frozenset:
    """The variables a template reads from its context (``jinja2.meta.find_undeclared_variables``)."""
    return frozenset(jinja2.meta.find_undeclared_variables(_ENV.parse(source)))


def render(template: jinja2.Template, context: dict, max_chars: int | None) -> str:
    """Render, stopping as soon as the output passes ``max_chars`` characters."""
    out, total = [], 0
    for chunk in template.generate(**context):
        total += len(chunk)
        if max_chars is not None and total > max_chars:
            raise TemplateLimitError(f"the rendered chat template is longer than {max_chars} characters")
        out.append(chunk)
    return "".join(out)


class TemplateTimeout(RuntimeError):
    """A worker did not finish rendering within the timeout and was killed."""


class TemplateBusy(RuntimeError):
    """Every worker is rendering; the request is refused rather than queued."""


class TemplateWorkers:
    """Worker processes that render one client template at a time each; a worker that overruns ``timeout_s``
    is killed and replaced. ``render`` blocks (call it off the event loop)."""

    def __init__(self, size: int = 2, timeout_s: float = 5.0):
        self.timeout_s, self.size = timeout_s, size
        self._idle: list[subprocess.Popen] = []
        self._slots = threading.BoundedSemaphore(size)
        self._lock = threading.Lock()
        self.num_killed = 0

    def _spawn(self) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "fastdeploy_ext.engine.template_sandbox"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                start_new_session=True)

    def render(self, source: str, context: dict, max_chars: int | None) -> str:
        request = (json.dumps({"source": source, "context": context, "max_chars": max_chars}) + "\n").encode()
        # Never queue behind a busy worker: a handful of slow templates must not hold every handler thread.
        if not self._slots.acquire(blocking=False):
            raise TemplateBusy(f"all {self.size} chat-template workers are busy; retry later")
        try:
            with self._lock:
                proc = self._idle.pop() if self._idle else None
            if proc is None or proc.poll() is not None:
                proc = self._spawn()
            try:
                reply = self._exchange(proc, request)
            except BaseException:
                proc.kill()
                proc.wait()
                raise
            with self._lock:
                self._idle.append(proc)
        finally:
            self._slots.release()
        if "error" in reply:
            raise ValueError(reply["error"])
        return reply["text"]

    def _exchange(self, proc: subprocess.Popen, request: bytes) -> dict:
        proc.stdin.write(request)
        proc.stdin.flush()
        fd = proc.stdout.fileno()
        ready, _, _ = select.select([fd], [], [], self.timeout_s)
        if not ready:
            self.num_killed += 1
            raise TemplateTimeout(f"the chat template did not render within template_timeout_s={self.timeout_s:g} s; "
                                  "its worker was killed")
        line = proc.stdout.readline()
        if not line:
            raise ValueError("the chat template worker died while rendering (memory limit?)")
        return json.loads(line)

    def close(self) -> None:
        with self._lock:
            for proc in self._idle:
                proc.kill()
                proc.wait()
            self._idle.clear()


def _worker_main() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEMORY_BYTES, WORKER_MEMORY_BYTES))
    for line in sys.stdin:
        try:
            req = json.loads(line)
            reply = {"text": render(compile_template(req["source"]), req["context"], req["max_chars"])}
        except MemoryError:
            reply = {"error": "the chat template ran out of memory"}
        except Exception as e:
            reply = {"error": f"{type(e).__name__}: {e}"[:2000]}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    _worker_main()
