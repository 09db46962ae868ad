"""Count device -> host synchronisations of Paddle tensors (test helper).

On a GPU each of these waits for the device and copies to the host; the device path should do a fixed number per
engine step, never one per layer (issue 15). Counted while a :class:`SyncCounter` is active: calls of the
``paddle.Tensor`` methods ``numpy``, ``item``, ``tolist``, ``__array__`` (``np.asarray(t)``), ``__dlpack__``
(``np.from_dlpack(t)``), ``__bool__`` (``if t:``), ``__int__``, ``__float__``, ``__index__``, ``cpu``, and of
``paddle.utils.dlpack.to_dlpack`` (also where a ``fastdeploy_ext`` module bound it by name). Only the outermost call
counts (``tolist`` calling ``numpy`` is one sync). On the CPU nothing waits, but the calls are the same code the GPU
runs, so counting them here is the check.

Not counted: ops whose output shape depends on values (``nonzero``, ``masked_select``, ``unique``), which also wait
on a GPU; host -> device copies (``paddle.to_tensor``).
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import traceback
from collections import Counter

import paddle

TENSOR_METHODS = ("numpy", "item", "tolist", "__array__", "__dlpack__", "__bool__", "__int__", "__float__",
                  "__index__", "cpu")
_PACKAGE_DIR = os.sep + "fastdeploy_ext" + os.sep


class SyncCounter:
    """``with SyncCounter() as c: ...`` patches the methods above for the block; ``c.calls`` lists one
    ``(name, where)`` per counted call, ``where`` the innermost ``fastdeploy_ext`` frame (``file:line function``) or
    ``"?"`` when no package code is on the stack."""

    def __init__(self):
        self.calls: list[tuple[str, str]] = []
        self._local = threading.local()
        self._saved: list = []

    # ------------------------------------------------------------------ patching

    def _wrap(self, name, fn):
        counter = self

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            depth = getattr(counter._local, "depth", 0)
            if depth == 0:
                counter.calls.append((name, _package_frame()))
            counter._local.depth = depth + 1
            try:
                return fn(*args, **kwargs)
            finally:
                counter._local.depth = depth

        wrapper._sync_counter_original = fn
        return wrapper

    def _patch(self, owner, attr, name):
        original = getattr(owner, attr)
        self._saved.append((owner, attr, original))
        setattr(owner, attr, self._wrap(name, original))

    def __enter__(self):
        for m in TENSOR_METHODS:
            self._patch(paddle.Tensor, m, m)
        import paddle.utils.dlpack as dlpack

        original = dlpack.to_dlpack
        self._patch(dlpack, "to_dlpack", "to_dlpack")
        if getattr(paddle, "to_dlpack", None) is original:
            self._patch(paddle, "to_dlpack", "to_dlpack")
        for mod_name, mod in list(sys.modules.items()):
            if mod_name.startswith("fastdeploy_ext") and mod is not None:
                for attr, value in list(vars(mod).items()):
                    if value is original:
                        self._patch(mod, attr, "to_dlpack")
        return self

    def __exit__(self, *exc):
        for owner, attr, original in reversed(self._saved):
            setattr(owner, attr, original)
        self._saved.clear()
        return False

    # ------------------------------------------------------------------ reading

    def mark(self) -> int:
        return len(self.calls)

    def since(self, mark: int) -> list[tuple[str, str]]:
        return self.calls[mark:]


def _package_frame() -> str:
    for frame in reversed(traceback.extract_stack()[:-2]):
        if _PACKAGE_DIR in frame.filename:
            rel = frame.filename.split(_PACKAGE_DIR, 1)[1]
            return f"fastdeploy_ext/{rel}:{frame.lineno} {frame.name}"
    return "?"


def step_kind(seqs) -> str:
    """``"prefill"``, ``"decode"`` or ``"mixed"`` for a list of the scheduler's ``ScheduledSeq``."""
    prefill = [s.start < len(s.request.prompt_token_ids) for s in seqs]
    return "prefill" if all(prefill) else "decode" if not any(prefill) else "mixed"


def count_engine_steps(engine, counter: SyncCounter, drive) -> list[dict]:
    """Run ``drive(engine)`` with ``engine.step`` (an ``LLMEngine``) and ``engine.runner.execute`` wrapped: one record
    per step that ran the model, ``{"kind", "syncs", "calls"}`` (``calls`` a Counter of ``(name, where)``)."""
    records, current = [], {}
    step, execute = engine.step, engine.runner.execute

    def counted_execute(seqs):
        current["kind"] = step_kind(seqs)
        return execute(seqs)

    def counted_step():
        current.clear()
        mark = counter.mark()
        out = step()
        if "kind" in current:
            calls = counter.since(mark)
            records.append({"kind": current["kind"], "syncs": len(calls), "calls": Counter(calls)})
        return out

    engine.step, engine.runner.execute = counted_step, counted_execute
    try:
        drive(engine)
    finally:
        del engine.step
        del engine.runner.execute
    return records
