"""Architecture rules, checked on the source by ``ast`` (issue 15, "Prove it (CPU)"):

1. Layers and models pick their implementation once, at construction: no function in ``fastdeploy_ext/layers/`` or
   ``fastdeploy_ext/models/`` other than ``__init__``, weight loaders (names containing ``weight_loader`` or
   ``_load``), ``load_weights`` and ``process_weights_after_loading`` branches (``if``, ternary, ``while``) on a
   condition mentioning a place/backend predicate (:data:`BACKEND_WORDS`) or comparing a ``.dtype`` attribute, or
   calls ``np.from_dlpack``. An ``if`` whose body only raises (and has no ``else``) is a guard, not a choice of
   implementation, and is not counted.
2. Imports point one way, ops <- layers <- models <- engine <- entrypoints, and ``config`` imports none of them.
3. No import cycles among ``fastdeploy_ext`` modules.
4. No ``paddle.incubate`` function is reachable unguarded: every import of, or attribute reaching into,
   ``paddle.incubate`` sits inside an ``if`` whose condition calls ``cpu_flags`` (``ops/cpu_features.py``) or asks
   for a GPU (:data:`GPU_GUARDS`). Paddle's incubate CPU kernels are built for AVX-512 and die with SIGILL elsewhere.
5. Only the layers' backend choice (:data:`BACKEND_CHOICE`) and ``ops/`` itself import ``ops/host``.
6. Only the backend choice calls ``paddle.get_device()``.
7. One framework adapter for Triton launches (:data:`LAUNCH_ADAPTER`): no other class defines ``owns`` and ``launch``.

Imports are read everywhere in a module (function-level ones included; ``if TYPE_CHECKING:`` blocks excluded, they
never run). ``from pkg import name`` is an edge to ``pkg.name`` when that is a module, else to ``pkg``.

The package checked is the one ``fastdeploy_ext`` resolves to (``importlib.util.find_spec``, nothing imported), so
``PYTHONPATH=<another checkout>`` checks that checkout's tree.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import textwrap

import pytest

BACKEND_WORDS = ("place", "is_cpu_place", "is_gpu_place", "get_device", "is_compiled_with_cuda", "backend", "_packed",
                 "_on_host", "_on_gpu")
EXEMPT_EXACT = {"__init__", "load_weights", "process_weights_after_loading"}
EXEMPT_PARTS = ("weight_loader", "_load")
RANKS = {"ops": 0, "layers": 1, "models": 2, "engine": 3, "entrypoints": 4}


def package_dir() -> str:
    spec = importlib.util.find_spec("fastdeploy_ext")
    assert spec is not None and spec.submodule_search_locations, "fastdeploy_ext is not importable"
    return list(spec.submodule_search_locations)[0]


def modules(root: str) -> dict[str, str]:
    """``{dotted module name: path}`` of every .py file under the package (``pkg/__init__.py`` -> ``pkg``)."""
    out = {}
    base = os.path.dirname(root)
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for fn in sorted(filenames):
            if fn.endswith(".py"):
                path = os.path.join(dirpath, fn)
                parts = os.path.relpath(path, base)[:-3].split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                out[".".join(parts)] = path
    return out


def parse(path: str) -> ast.Module:
    with open(path, encoding="utf-8") as f:
        return ast.parse(f.read(), filename=path)


def rel(path: str, root: str) -> str:
    return os.path.relpath(path, os.path.dirname(root))


# ---------------------------------------------------------------- rule 1: no runtime backend branches


def _words(identifier: str) -> list[str]:
    return [w for w in identifier.split("_") if w]


def _mentions_backend(identifier: str) -> str | None:
    """The backend word ``identifier`` contains as whole ``_``-separated words (``backend_of`` mentions ``backend``,
    ``self._on_gpu`` and a local ``on_gpu`` mention ``_on_gpu``, ``replace`` mentions nothing), or None."""
    words = _words(identifier)
    for token in BACKEND_WORDS:
        t = _words(token)
        if any(words[i:i + len(t)] == t for i in range(len(words) - len(t) + 1)):
            return token
    return None


def _condition_findings(test: ast.AST) -> list[str]:
    """What makes ``test`` a backend branch, one string per reason (empty: none)."""
    mentions, compares = {}, None
    for node in ast.walk(test):
        ident = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
        token = None if ident is None else _mentions_backend(ident)
        if token is not None:
            mentions.setdefault(token, []).append(ident)
        if compares is None and isinstance(node, ast.Compare):
            for operand in [node.left, *node.comparators]:
                if any(isinstance(n, ast.Attribute) and n.attr == "dtype" for n in ast.walk(operand)):
                    compares = f"compares .dtype ({ast.unparse(node)[:80]})"
                    break
    found = [f"mentions {t!r} ({', '.join(sorted(set(ids)))})" for t, ids in mentions.items()]
    return found + ([compares] if compares else [])


def _exempt(name: str) -> bool:
    return name in EXEMPT_EXACT or any(p in name for p in EXEMPT_PARTS)


class _BranchFinder(ast.NodeVisitor):
    def __init__(self, path: str, root: str):
        self.path, self.root, self.stack, self.found = path, root, [], []

    def _visit_function(self, node):
        self.stack.append(node.name)
        self.generic_visit(node)
        self.stack.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = _visit_function

    def _where(self, node) -> str | None:
        """``path:line qualified.function`` when inside a checked function, else None."""
        if not self.stack or _exempt(self.stack[-1]):
            return None
        return f"{rel(self.path, self.root)}:{node.lineno} {'.'.join(self.stack)}"

    def _branch(self, node, kind):
        where = self._where(node)
        if where is not None:
            for finding in _condition_findings(node.test):
                self.found.append(f"{where}: {kind} {finding}")
        self.generic_visit(node)

    def visit_If(self, node):
        if not node.orelse and all(isinstance(stmt, ast.Raise) for stmt in node.body):
            self.generic_visit(node)  # a guard that only raises chooses no implementation
            return
        self._branch(node, "if")

    def visit_IfExp(self, node):
        self._branch(node, "ternary")

    def visit_While(self, node):
        self._branch(node, "while")

    def visit_Call(self, node):
        f = node.func
        if (isinstance(f, ast.Attribute) and f.attr == "from_dlpack" and isinstance(f.value, ast.Name)
                and f.value.id in ("np", "numpy")):
            where = self._where(node)
            if where is not None:
                self.found.append(f"{where}: calls {f.value.id}.from_dlpack")
        self.generic_visit(node)


def backend_branches(root: str) -> list[str]:
    found = []
    for name, path in modules(root).items():
        if name.split(".")[1:2] in (["layers"], ["models"]):
            finder = _BranchFinder(path, root)
            finder.visit(parse(path))
            found += finder.found
    return found


def test_no_backend_branches_in_layers_and_models():
    found = backend_branches(package_dir())
    assert not found, (f"{len(found)} runtime branch(es) on the place/backend/dtype, or np.from_dlpack calls, in "
                       "layers/ and models/ (choose the implementation in __init__):\n  " + "\n  ".join(found))


# ---------------------------------------------------------------- rules 2 and 3: the import graph


def _is_type_checking(test: ast.AST) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.Module):
    """Import / ImportFrom nodes anywhere in ``tree`` outside ``if TYPE_CHECKING:`` bodies."""
    todo = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))


def import_graph(root: str) -> dict[str, dict[str, int]]:
    """``{module: {imported module: line of the first such import}}`` among the package's modules."""
    mods = modules(root)
    graph = {m: {} for m in mods}
    for name, path in mods.items():
        is_pkg = os.path.basename(path) == "__init__.py"
        for node in _imports(parse(path)):
            targets = []
            if isinstance(node, ast.Import):
                for alias in node.names:
                    parts = alias.name.split(".")
                    hit = next((".".join(parts[:k]) for k in range(len(parts), 0, -1) if ".".join(parts[:k]) in mods),
                               None)
                    targets.append(hit)
            else:
                if node.level:
                    pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                    pkg = pkg[: len(pkg) - (node.level - 1)]
                    base = ".".join(pkg + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in mods else base if base in mods else None)
            for t in targets:
                if t is not None and t != name:
                    graph[name].setdefault(t, node.lineno)
    return graph


def _area(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def layering_violations(root: str) -> list[str]:
    graph, mods, out = import_graph(root), modules(root), []
    for src, targets in sorted(graph.items()):
        a = _area(src)
        for dst, line in sorted(targets.items()):
            b = _area(dst)
            if a == "config" and b in RANKS:
                out.append(f"{rel(mods[src], root)}:{line} imports {dst} (config imports none of {', '.join(RANKS)})")
            elif a in RANKS and b in RANKS and RANKS[b] > RANKS[a]:
                out.append(f"{rel(mods[src], root)}:{line} imports {dst} ({a} sits below {b})")
    return out


def import_cycles(root: str) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted, in sorted order."""
    graph = import_graph(root)
    index, low, on_stack, stack, sccs, counter = {}, {}, set(), [], [], [0]

    def strongconnect(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                sccs.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return sorted(sccs)


def _cycle_edges(root: str, comp: list[str]) -> list[str]:
    graph, mods = import_graph(root), modules(root)
    members = set(comp)
    return [f"{rel(mods[s], root)}:{line} -> {d}" for s in comp for d, line in sorted(graph[s].items()) if d in members]


def test_imports_point_one_way():
    found = layering_violations(package_dir())
    assert not found, "imports against ops <- layers <- models <- engine <- entrypoints (config imports none):\n  " + \
        "\n  ".join(found)


def test_no_import_cycles():
    root = package_dir()
    cycles = import_cycles(root)
    assert not cycles, "import cycles among fastdeploy_ext modules:\n" + "\n".join(
        f"  {' <-> '.join(c)}\n    " + "\n    ".join(_cycle_edges(root, c)) for c in cycles)


# ---------------------------------------------------------------- rule 4: paddle.incubate behind a guard

GPU_GUARDS = ("cpu_flags", "is_gpu_place", "is_compiled_with_cuda")


def _is_incubate(node: ast.AST) -> bool:
    if isinstance(node, ast.ImportFrom):
        return (node.module or "").startswith("paddle.incubate") or (
            node.module == "paddle" and any(a.name == "incubate" for a in node.names))
    if isinstance(node, ast.Import):
        return any(a.name.startswith("paddle.incubate") for a in node.names)
    return isinstance(node, ast.Attribute) and node.attr == "incubate"


def unguarded_incubate(root: str) -> list[str]:
    found = []
    for name, path in modules(root).items():
        todo = [(parse(path), False)]
        while todo:
            node, guarded = todo.pop()
            if _is_incubate(node) and not guarded:
                found.append(f"{rel(path, root)}:{node.lineno}")
            for child in ast.iter_child_nodes(node):
                inside = guarded or (isinstance(node, ast.If) and child in node.body and any(
                    g in ast.unparse(node.test) for g in GPU_GUARDS))
                todo.append((child, inside))
    return sorted(found)


def test_no_unguarded_paddle_incubate():
    found = unguarded_incubate(package_dir())
    assert not found, ("paddle.incubate reached without a CPU-feature or GPU guard (its CPU kernels need "
                       "AVX-512):\n  " + "\n  ".join(found))


# ---------------------------------------------------------------- the checker itself


def test_checker_sees_what_it_should(tmp_path):
    """A planted package: each rule fires on its case and stays quiet on the exempt and harmless ones."""
    pkg = tmp_path / "fastdeploy_ext"
    files = {
        "__init__.py": "",
        "config/__init__.py": "",
        "config/base.py": "from fastdeploy_ext.quantization import methods\n",
        "quantization/__init__.py": "",
        "quantization/methods.py": "def f():\n    from fastdeploy_ext.config.base import X\n",
        "ops/__init__.py": "",
        "ops/k.py": "from ..layers import attn\n",
        "layers/__init__.py": "",
        "layers/attn.py": (
            "import numpy as np\n"
            "class A:\n"
            "    def __init__(self, x):\n"
            "        if x.place.is_gpu_place():\n            pass\n"
            "    def weight_loader(self, p):\n"
            "        if self._packed is not None:\n            pass\n"
            "    def forward(self, x):\n"
            "        y = 1 if self._on_gpu() else 2\n"
            "        if x.dtype == 'float32':\n            pass\n"
            "        while backend_of(x):\n            pass\n"
            "        z = x.replace('a', 'b') if x.inplace else x\n"
            "        if x.dtype != 'float32':\n            raise TypeError(x)\n"
            "        return np.from_dlpack(x)\n"
        ),
        "models/__init__.py": "",
        "models/m.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from fastdeploy_ext.engine import e\n",
        "ops/inc.py": (
            "import paddle\n"
            "from paddle.incubate.nn.functional import fused_rms_norm\n"
            "def f(x):\n"
            "    return paddle.incubate.nn.functional.swiglu(x)\n"
            "def g(x):\n"
            "    if 'avx512f' in cpu_flags():\n"
            "        from paddle.incubate.nn import functional\n"
            "    else:\n"
            "        from paddle import incubate\n"
            "    if x.place.is_gpu_place():\n"
            "        return paddle.incubate.softmax_mask_fuse(x)\n"
        ),
        "engine/__init__.py": "",
        "engine/e.py": "",
    }
    for name, text in files.items():
        path = pkg / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    root = str(pkg)
    assert unguarded_incubate(root) == ["fastdeploy_ext/ops/inc.py:2", "fastdeploy_ext/ops/inc.py:4", "fastdeploy_ext/ops/inc.py:9"]
    found = backend_branches(root)
    assert [re.sub(r"^.*?:(\d+) ", r"\1 ", f).split(":")[0] for f in found] == \
        ["10 forward", "11 forward", "13 forward", "18 forward"], found
    assert layering_violations(root) == [
        "fastdeploy_ext/ops/k.py:1 imports fastdeploy_ext.layers.attn (ops sits below layers)"]
    assert import_cycles(root) == [["fastdeploy_ext.config.base", "fastdeploy_ext.quantization.methods"]]


def _flag_dests(command: str) -> set[str]:
    import argparse

    from fastdeploy_ext.entrypoints.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    return {a.dest for a in sub._actions if a.option_strings}


def _attributes_read(source: str) -> set[str]:
    return {n.attr for n in ast.walk(ast.parse(textwrap.dedent(source))) if isinstance(n, ast.Attribute)}


def test_engine_arguments_are_one_set():
    """The engine's arguments (the fields of ``EngineArgs``) are, every one of them by the same name, keywords of
    ``LLM``, fields of a deployment config, and flags of ``serve`` and ``generate``; whatever else ``LLM`` takes is a
    config field too; and ``plan`` offers exactly the engine fields that the planner's code reads (directly, or
    through a property or method of the config)."""
    import dataclasses
    import inspect

    from fastdeploy_ext import LLM
    from fastdeploy_ext.engine.engine import EngineArgs
    from fastdeploy_ext.entrypoints import deploy_config

    engine = {f.name for f in dataclasses.fields(EngineArgs)}
    keywords = set(inspect.signature(LLM).parameters)
    views = {"LLM keywords": keywords, "config fields": set(deploy_config.FIELDS), "serve flags": _flag_dests("serve"),
             "generate flags": _flag_dests("generate")}
    missing = {view: sorted(engine - names) for view, names in views.items() if engine - names}
    assert not missing, f"engine arguments missing from: {missing}"
    assert keywords <= set(deploy_config.FIELDS), f"LLM keywords with no config field: {sorted(keywords - engine)}"

    with open(os.path.join(package_dir(), "entrypoints", "planner.py"), encoding="utf-8") as f:
        read = _attributes_read(f.read())
    for name in list(read):
        member = inspect.getattr_static(deploy_config.DeployConfig, name, None)
        member = member.fget if isinstance(member, property) else member
        if inspect.isfunction(member):
            read |= _attributes_read(inspect.getsource(member))
    read &= engine
    offered = _flag_dests("plan") & engine
    assert read == offered, (f"the planner reads but plan does not offer: {sorted(read - offered)}; plan offers but "
                             f"the planner ignores: {sorted(offered - read)}")


ENGINE_INTERNALS = ("scheduler", "block_manager", "runner")


def engine_internals_in_server(root: str) -> list[str]:
    """Attributes (and ``getattr`` names) of :data:`ENGINE_INTERNALS` in the server's modules
    (``entrypoints/openai*``): the server asks the engine through ``stats()`` and ``health()``."""
    found = []
    for name, path in modules(root).items():
        if not name.startswith("fastdeploy_ext.entrypoints.openai"):
            continue
        for node in ast.walk(parse(path)):
            attr = None
            if isinstance(node, ast.Attribute):
                attr = node.attr
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                  and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)):
                attr = node.args[1].value
            if attr in ENGINE_INTERNALS:
                found.append(f"{rel(path, root)}:{node.lineno} .{attr}")
    return found


def test_server_does_not_reach_into_the_engine():
    assert engine_internals_in_server(package_dir()) == []


def test_engine_internals_checker_sees_what_it_should(tmp_path):
    pkg = tmp_path / "fastdeploy_ext"
    files = {
        "__init__.py": "",
        "entrypoints/__init__.py": "",
        "entrypoints/openai/__init__.py": "",
        "entrypoints/openai/loop.py": ("def f(engine):\n    s = engine.scheduler.running\n"
                                       "    return getattr(engine, 'runner', None), engine.stats()\n"),
        "entrypoints/cli.py": "def g(llm):\n    return llm.llm_engine.block_manager\n",
    }
    for name, text in files.items():
        path = pkg / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert engine_internals_in_server(str(pkg)) == ["fastdeploy_ext/entrypoints/openai/loop.py:2 .scheduler",
                                                    "fastdeploy_ext/entrypoints/openai/loop.py:3 .runner"]


# ---------------------------------------------------------------- one place per model

# The architectures the package serves; a model package declares its own through its spec module's
# ``architecture=`` fields, which are added to these.
KNOWN_ARCHITECTURES = ("Qwen2ForCausalLM", "MiniMaxM1ForCausalLM", "MiniMaxText01ForCausalLM", "MiniMaxForCausalLM",
                       "MiDashengLMModel")


def declared_architectures(root: str) -> set[str]:
    """``architecture="..."`` keyword values in ``models/<package>/spec.py`` files (read, not imported)."""
    found = set()
    for name, path in modules(root).items():
        parts = name.split(".")
        if parts[1:2] == ["models"] and len(parts) == 4 and parts[3] == "spec":
            for node in ast.walk(parse(path)):
                if isinstance(node, ast.keyword) and node.arg == "architecture" and isinstance(node.value, ast.Constant):
                    found.add(node.value.value)
    return found


def architecture_mentions(root: str) -> list[str]:
    """``path:line name`` of every architecture name in the package outside the model packages
    (``models/<package>/``): shared code reads a model's parser, adapter, tables and hooks from the registry."""
    names = sorted(set(KNOWN_ARCHITECTURES) | declared_architectures(root), key=len, reverse=True)
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, names)) + r")\b")
    models_dir = os.path.join(root, "models")
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        if os.path.dirname(dirpath) == models_dir:
            dirnames[:] = []  # a model's own package
            continue
        for fn in sorted(filenames):
            path = os.path.join(dirpath, fn)
            try:
                with open(path, encoding="utf-8") as f:
                    lines = f.read().splitlines()
            except UnicodeDecodeError:
                continue
            found += [f"{rel(path, root)}:{i} {m}" for i, line in enumerate(lines, 1) for m in pattern.findall(line)]
    return found


def test_architecture_names_only_in_their_model_package():
    root = package_dir()
    found = architecture_mentions(root)
    assert not found, ("architecture names outside their model package (read them from models/registry.py "
                       "instead):\n  " + "\n  ".join(found))
    assert set(KNOWN_ARCHITECTURES) <= declared_architectures(root), "a served architecture has no spec"


# The input path has one definition site per step (engine/processor.py): the audio-part parser, the chat-template
# renderer, the multimodal processor call and the grammar compile. Besides it, only the tokenizer (which defines the
# rendering) and the models (which define their multimodal processor) name them.
INPUT_PATH = "fastdeploy_ext.engine.processor"
INPUT_PATH_EXEMPT = {"apply_chat_template": ("fastdeploy_ext.engine.tokenizer",),
                     "chat_template_context": ("fastdeploy_ext.engine.tokenizer",),
                     "multimodal_processor": ("fastdeploy_ext.models",)}
AUDIO_PART_TYPES = ("input_audio", "audio_url")


def input_steps_outside_processor(root: str) -> list[str]:
    """Sites outside :data:`INPUT_PATH` that parse audio parts (the part type strings inside a function), render a
    chat template, call the model's multimodal processor (attribute or ``getattr`` name) or compile a grammar
    (``compile_guided`` or ``.compile(<x>.guided_decoding)``)."""
    found = []
    for name, path in modules(root).items():
        if name == INPUT_PATH:
            continue
        for func in ast.walk(parse(path)):
            if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(func):
                what = None
                if isinstance(node, ast.Constant) and node.value in AUDIO_PART_TYPES:
                    what = f"audio part {node.value!r}"
                elif isinstance(node, ast.Attribute) and node.attr in INPUT_PATH_EXEMPT:
                    what = node.attr
                elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                      and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)
                      and node.args[1].value in INPUT_PATH_EXEMPT):
                    what = node.args[1].value
                elif isinstance(node, ast.Attribute) and node.attr == "compile_guided":
                    what = "grammar compile"
                elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "compile"
                      and node.args and isinstance(node.args[0], ast.Attribute)
                      and node.args[0].attr == "guided_decoding"):
                    what = "grammar compile"
                if what is None or name.startswith(INPUT_PATH_EXEMPT.get(what, ("\0",))):
                    continue
                found.append(f"{rel(path, root)}:{node.lineno} {what}")
    return sorted(set(found))


def test_each_input_step_has_one_definition_site():
    root = package_dir()
    assert input_steps_outside_processor(root) == []
    graph = import_graph(root)
    front = [m for m in graph if m in ("fastdeploy_ext.engine.llm", "fastdeploy_ext.entrypoints.cli")
             or m.startswith(("fastdeploy_ext.entrypoints.openai", "fastdeploy_ext.entrypoints.server"))]
    assert {"fastdeploy_ext.engine.llm", "fastdeploy_ext.entrypoints.cli"} <= set(front)
    assert [m for m in front if INPUT_PATH in graph[m]], "no entry point imports the input processor"
    assert [m for m in ("fastdeploy_ext.engine.llm", "fastdeploy_ext.entrypoints.cli") if INPUT_PATH not in graph[m]] == []
    assert any(INPUT_PATH in graph[m] for m in front if "server" in m), "the server does not import the input processor"


def test_input_step_checker_sees_what_it_should(tmp_path):
    pkg = tmp_path / "fastdeploy_ext"
    files = {
        "__init__.py": "",
        "engine/__init__.py": "",
        "engine/processor.py": "def p(part, tok, m, g, params):\n    return part['type'] == 'input_audio'\n",
        "engine/tokenizer.py": "def r(self):\n    return self.chat_template_context()\n",
        "models/__init__.py": "",
        "models/m.py": "def f(self):\n    return self.multimodal_processor\n",
        "entrypoints/__init__.py": "",
        "entrypoints/front.py": ("def a(part, tok, model, engine, params, guided):\n"
                                 "    if part.type == 'audio_url':\n"
                                 "        tok.apply_chat_template([])\n"
                                 "    getattr(model, 'multimodal_processor', None)\n"
                                 "    engine.compile_guided(params, [])\n"
                                 "    return guided.compile(params.guided_decoding, False)\n"),
        "entrypoints/protocol.py": "class P:\n    type = 'input_audio'\n",
    }
    for name, text in files.items():
        path = pkg / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert input_steps_outside_processor(str(pkg)) == [
        "fastdeploy_ext/entrypoints/front.py:2 audio part 'audio_url'",
        "fastdeploy_ext/entrypoints/front.py:3 apply_chat_template",
        "fastdeploy_ext/entrypoints/front.py:4 multimodal_processor",
        "fastdeploy_ext/entrypoints/front.py:5 grammar compile",
        "fastdeploy_ext/entrypoints/front.py:6 grammar compile",
    ]


# ---------------------------------------------------------------- rules 5 and 6: one backend choice

# The layers' backend choice: the only module outside ops/ that imports ops/host or asks Paddle for the device.
BACKEND_CHOICE = ("fastdeploy_ext.layers.backend",)


def host_imports_outside_choice(root: str) -> list[str]:
    """Imports of ``fastdeploy_ext.ops.host`` (or a module in it) from outside ``ops/`` and :data:`BACKEND_CHOICE`:
    models, the engine and the other layers reach a host implementation through the backend choice."""
    graph, mods = import_graph(root), modules(root)
    return [f"{rel(mods[src], root)}:{line} imports {dst}" for src, targets in sorted(graph.items())
            if _area(src) != "ops" and src not in BACKEND_CHOICE
            for dst, line in sorted(targets.items()) if dst == "fastdeploy_ext.ops.host"
            or dst.startswith("fastdeploy_ext.ops.host.")]


def device_queries_outside_choice(root: str) -> list[str]:
    """Calls of ``paddle.get_device()`` (or ``paddle.device.get_device()``) outside :data:`BACKEND_CHOICE`: whether a
    GPU runs is asked one way, there."""
    found = []
    for name, path in modules(root).items():
        if name in BACKEND_CHOICE:
            continue
        for node in ast.walk(parse(path)):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get_device"
                    and ast.unparse(node.func.value) in ("paddle", "paddle.device")):
                found.append(f"{rel(path, root)}:{node.lineno}")
    return found


def test_ops_host_imported_only_by_the_backend_choice():
    found = host_imports_outside_choice(package_dir())
    assert not found, (f"ops/host imported outside ops/ and {', '.join(BACKEND_CHOICE)} (call a layer, or add the "
                       "implementation to the backend choice):\n  " + "\n  ".join(found))


def test_gpu_presence_asked_only_by_the_backend_choice():
    found = device_queries_outside_choice(package_dir())
    assert not found, (f"paddle.get_device() outside {', '.join(BACKEND_CHOICE)} (ask the backend choice, which reads "
                       "the engine's resolved load_config.device):\n  " + "\n  ".join(found))


def test_backend_choice_checker_sees_what_it_should(tmp_path):
    """A planted package: ops/host imports and device queries fire outside the choice, stay quiet inside it and
    inside ops/."""
    pkg = tmp_path / "fastdeploy_ext"
    files = {
        "__init__.py": "",
        "ops/__init__.py": "",
        "ops/host/__init__.py": "def host_view(t):\n    return t\n",
        "ops/host/gemm.py": "from fastdeploy_ext.ops.host import host_view\n",
        "ops/launch.py": "import paddle\nON = paddle.get_device()\n",
        "layers/__init__.py": "",
        "layers/backend.py": ("import paddle\nfrom fastdeploy_ext.ops.host import gemm\n"
                              "def on_gpu():\n    return paddle.get_device().startswith('gpu')\n"),
        "layers/attn.py": ("import paddle\nfrom fastdeploy_ext.layers import backend\n"
                           "def f():\n    from fastdeploy_ext.ops.host.gemm import host_view\n"
                           "    return paddle.device.get_device(), paddle.device.cuda.get_device_capability()\n"),
        "models/__init__.py": "",
        "models/m.py": "from fastdeploy_ext.ops.host import host_view\nfrom fastdeploy_ext.ops import launch\n",
        "engine/__init__.py": "",
        "engine/e.py": "import fastdeploy_ext.ops.host.gemm\nimport paddle\nX = paddle.get_device\n",
    }
    for name, text in files.items():
        path = pkg / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    root = str(pkg)
    assert host_imports_outside_choice(root) == [
        "fastdeploy_ext/engine/e.py:1 imports fastdeploy_ext.ops.host.gemm",
        "fastdeploy_ext/layers/attn.py:4 imports fastdeploy_ext.ops.host.gemm",
        "fastdeploy_ext/models/m.py:1 imports fastdeploy_ext.ops.host"]
    assert sorted(device_queries_outside_choice(root)) == ["fastdeploy_ext/layers/attn.py:5",
                                                           "fastdeploy_ext/ops/launch.py:2"]


# ---------------------------------------------------------------- rule 7: one launch adapter

LAUNCH_ADAPTER = "fastdeploy_ext.ops.launch"


def launch_adapters_outside(root: str) -> list[str]:
    """Classes outside :data:`LAUNCH_ADAPTER` that define the adapter surface (both ``owns`` and ``launch``): every
    op's launcher takes torch or Paddle tensors through the one adapter."""
    found = []
    for name, path in modules(root).items():
        if name == LAUNCH_ADAPTER:
            continue
        for node in ast.walk(parse(path)):
            if isinstance(node, ast.ClassDef):
                methods = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
                if {"owns", "launch"} <= methods:
                    found.append(f"{rel(path, root)}:{node.lineno} {node.name}")
    return found


def test_one_launch_adapter():
    found = launch_adapters_outside(package_dir())
    assert not found, f"framework adapters for Triton launches outside {LAUNCH_ADAPTER}:\n  " + "\n  ".join(found)


if __name__ == "__main__":  # pragma: no cover - a quick report
    r = package_dir()
    print("\n".join(backend_branches(r) + layering_violations(r) + host_imports_outside_choice(r)
                    + device_queries_outside_choice(r) + launch_adapters_outside(r)))
    print(import_cycles(r))
    pytest.main([__file__])
