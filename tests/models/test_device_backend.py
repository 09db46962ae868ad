"""The device backend (``LLM(..., backend="device")``: plain Paddle ops, the path a GPU runs) on the CPU, in float32 and
float64, against references we did not write (issue 15, "Prove it (CPU)").

Oracles: float32, the project's usual ones (each model package's ``align`` module: HF ``Qwen2ForCausalLM``, HF
``MiniMaxForCausalLM`` with partial RoPE patched in, the dasheng + torch projector + HF Qwen2 composite for
MiDashengLM). float64, the same models in float64 with transformers' internal float32 casts removed by OUR test-side
patch (tests/hf_float64.py; ``test_hf_float64_patch_is_live`` shows it changes float64 results and leaves the math
alone), the MiDashengLM frontend from librosa in float64.

Tolerances: float32 logprobs 1e-4 (the Qwen2 budget of the host-backend tests), float64 logprobs 1e-9 (two float64
implementations of the same math agree to ~1e-13 on these tiny models; 1e-9 fails any float32 step on the way).
Greedy tokens must equal the oracle's until a near-tie (oracle top-2 gap < 1e-4), where the oracle's token is fed
back (tests/oracle.py).

Also here: forward hooks asserting every layer returns its input dtype (Paddle promotes float32 + float64
elementwise silently), and one tiny MiniMax-M1 forward with the Triton lightning kernels forced
(``FDEXT_LIGHTNING_KERNELS=triton`` under ``TRITON_INTERPRET=1``, float32) against HF.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import torch
import transformers  # noqa: F401  (the test extra installs it; missing = a failed install)

from fastdeploy_ext import LLM, SamplingParams  # noqa: E402
from fastdeploy_ext.models.midashenglm.align import MiDashengLMOracle  # noqa: E402
from fastdeploy_ext.tiny import write_tiny  # noqa: E402
from tests import hf_float64  # noqa: E402
from tests.oracle import check_greedy_against_oracle, engine_greedy, hf_logprobs  # noqa: E402

ARCHS = {"qwen2": "Qwen2ForCausalLM", "m1_original": "MiniMaxM1ForCausalLM", "m1_hf_native": "MiniMaxForCausalLM",
         "midashenglm": "MiDashengLMModel"}
DTYPES = ["float32", "float64"]
ATOL = {"float32": 1e-4, "float64": 1e-9}
LENGTHS = {"len1": (1, 11), "len17": (17, 12), "len255": (255, 13), "len257": (257, 14)}
TEXT_VOCAB = 400  # below every tiny tokenizer's special tokens
MAX_TOKENS = 16
SR = 16000
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def random_ids(length, seed):
    return np.random.default_rng(seed).integers(0, TEXT_VOCAB, size=length).tolist()


def clip(seconds: float, seed: int) -> np.ndarray:
    """A chirp with an amplitude envelope plus noise (as tests/models/test_midashenglm.py)."""
    n = int(round(seconds * SR))
    rng = np.random.default_rng(seed)
    t = np.arange(n) / SR
    tone = np.sin(2 * np.pi * (250 + 600 * t / seconds) * t) * (0.2 + 0.15 * np.sin(2 * np.pi * 0.7 * t))
    return (tone + 0.03 * rng.standard_normal(n)).astype(np.float32)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    dirs = {}
    for key, arch in ARCHS.items():
        dirs[key] = str(tmp_path_factory.mktemp(f"dev_{key}"))
        write_tiny(arch, dirs[key], seed=0)
    return dirs


# ---------------------------------------------------------------- oracles


class AudioOracle:
    """``(ids, audio positions, clips) -> log-softmax rows``: the composite oracle in float32, or its float64 version."""

    def __init__(self, model_dir, dtype):
        from tests.layers.test_dasheng_encoder import import_dasheng

        import_dasheng()  # the torchaudio workaround, or a skip
        self.dtype = dtype
        self.impl = (MiDashengLMOracle if dtype == "float32" else hf_float64.MiDashengLMFloat64Oracle)(model_dir)

    def __call__(self, ids, positions=(), clips=()):
        if not clips:
            if self.dtype == "float32":
                return hf_logprobs(self.impl.decoder, ids)
            with hf_float64.hf_float64():
                return hf_float64.logprobs(self.impl.decoder, ids)
        rows = torch.cat([self.impl.audio_rows(c) for c in clips])
        if self.dtype == "float32":
            return self.impl.logprobs(ids, positions, rows)
        with hf_float64.hf_float64():
            return self.impl.logprobs(ids, positions, rows)


@pytest.fixture(scope="module", params=[(m, d) for m in ARCHS for d in DTYPES], ids=lambda p: f"{p[0]}-{p[1]}")
def case(request, model_dirs):
    """(key, dtype, engine on the device backend, oracle) shared by every test of one model x dtype."""
    key, dtype = request.param
    d = model_dirs[key]
    oracle = AudioOracle(d, dtype) if key == "midashenglm" else hf_float64.text_oracle(d, dtype)
    llm = LLM(model=d, backend="device", dtype=dtype, max_model_len=512, max_num_seqs=8, block_size=16)
    assert llm.llm_engine.fd_config.load_config.backend == "device"
    return key, dtype, llm, oracle


# ---------------------------------------------------------------- the patch of tests/hf_float64.py is live


@pytest.mark.parametrize("key", ["qwen2", "m1_original"])
def test_hf_float64_patch_is_live(model_dirs, key):
    """Stock and patched HF float64 logprobs differ by more than 1e-8 (the patch removes float32 steps); patched
    float64 agrees with stock float32 within float32 rounding (1e-4 here, measured ~1e-5); patched float32 equals
    stock float32 exactly (the patch only changes what runs in float64)."""
    load = hf_float64.load_qwen2 if key == "qwen2" else hf_float64.load_minimax
    m32, m64 = load(model_dirs[key], "float32"), load(model_dirs[key], "float64")
    ids = random_ids(100, 5)
    stock32, stock64 = hf_float64.logprobs(m32, ids), hf_float64.logprobs(m64, ids)
    with hf_float64.hf_float64():
        patched32, patched64 = hf_float64.logprobs(m32, ids), hf_float64.logprobs(m64, ids)
    assert stock64.dtype == patched64.dtype == np.float64
    live = float(np.abs(stock64 - patched64).max())
    print(f"\n{key}: |stock64 - patched64| = {live:.3g}, |patched64 - stock32| = {np.abs(patched64 - stock32).max():.3g}")
    assert live > 1e-8
    assert np.abs(patched64 - stock32).max() <= 1e-4
    assert np.array_equal(patched32, stock32)
    # and the context manager restores transformers' own functions
    from transformers.models.qwen2 import modeling_qwen2

    assert modeling_qwen2.Qwen2RMSNorm.forward is not hf_float64._rms_norm_forward


# ---------------------------------------------------------------- alignment with the oracles


def _audio_prompt(llm, length, seed):
    """(unexpanded ids, expanded ids, audio positions, clips): a 1 s clip (5 audio tokens) among random text, the
    expansion ``length`` tokens long."""
    tok = llm.tokenizer
    audio = tok.encode("<|audio_bos|><|AUDIO|><|audio_eos|>", add_special_tokens=False)
    assert len(audio) == 3
    clips = [clip(1.0, seed)]
    n_audio = 5
    text = random_ids(length - n_audio - 2, seed)
    cut = len(text) // 3
    base = text[:cut] + audio + text[cut:]
    _, expanded, inputs = llm.llm_engine.model.multimodal_processor(tok, None, base, {"audio": clips})
    assert len(expanded) == length and inputs.num_tokens == [n_audio]
    return base, expanded, list(inputs.positions), clips


@pytest.mark.parametrize("length,seed", list(LENGTHS.values()), ids=list(LENGTHS))
def test_greedy_and_logprobs_match_oracle(case, length, seed):
    key, dtype, llm, oracle = case
    atol = ATOL[dtype]
    if key == "midashenglm" and length > 100:
        base, expanded, positions, clips = _audio_prompt(llm, length, seed)

        def oracle_fn(ids):
            return oracle(ids, positions, clips)

        def generate_fn(ids, n):
            params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=3)
            out = llm.generate({"prompt_token_ids": base + ids[len(expanded):], "multimodal_data": {"audio": clips}},
                               params, use_tqdm=False)[0]
            assert out.prompt_token_ids == ids
            return out.outputs.token_ids, out.outputs.logprobs

        prompt = {"prompt_token_ids": base, "multimodal_data": {"audio": clips}}
    else:
        expanded = random_ids(length, seed)
        oracle_fn, generate_fn = oracle, engine_greedy(llm)
        prompt = {"prompt_token_ids": expanded}
    produced, ties, worst = check_greedy_against_oracle(generate_fn, oracle_fn, expanded, MAX_TOKENS, atol=atol)
    print(f"\n{key} {dtype} len {length}: {produced} tokens, {ties} near-ties, max |logprob diff| {worst:.3g}")
    assert produced == MAX_TOKENS and worst <= atol

    if length > 1:  # every prompt position too
        out = llm.generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=3), use_tqdm=False)[0]
        ref = oracle_fn(expanded)
        worst_prompt = 0.0
        for i in range(1, len(expanded)):
            for t, v in out.prompt_logprobs[i].items():
                worst_prompt = max(worst_prompt, abs(v - float(ref[i - 1][t])))
        print(f"  prompt logprobs: max |diff| {worst_prompt:.3g}")
        assert worst_prompt <= atol


def test_logits_and_reported_logprobs_keep_the_compute_dtype(case):
    """The model's logits come back in the compute dtype, and the logprobs the engine reports keep that precision:
    under float64 some of them are not float32 numbers (a float32 log-softmax on the host would round them all)."""
    key, dtype, llm, _ = case
    model = llm.llm_engine.model
    seen = []
    original = model.compute_logits

    def spy(hidden):
        out = original(hidden)
        seen.append(str(out.dtype))
        return out

    model.compute_logits = spy
    try:
        out = llm.generate({"prompt_token_ids": random_ids(12, 8)},
                           SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=5), use_tqdm=False)[0]
    finally:
        del model.compute_logits
    assert seen and set(seen) == {f"paddle.{dtype}"}, seen
    values = [v for entry in out.outputs.logprobs for v in entry.values()]
    representable = [float(np.float32(v)) == v for v in values]
    if dtype == "float64":
        assert not all(representable), f"every reported logprob is a float32 number: {values[:5]}"
    else:
        assert all(representable)


# ---------------------------------------------------------------- dtype discipline


def _float_tensors(x):
    import paddle

    if isinstance(x, paddle.Tensor):
        return [x] if x.is_floating_point() else []
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _float_tensors(item)]
    return []


def test_every_layer_returns_its_input_dtype(case):
    """A forward post-hook on every sublayer of the model: each floating output has the dtype of the layer's first
    floating input; a layer fed no floating tensor (the embedding, fed ids) returns the compute dtype. One
    prefill-and-decode run (with a clip for MiDashengLM)."""
    key, dtype, llm, _ = case
    model = llm.llm_engine.model
    bad, seen = {}, set()

    def hook(name):
        def check(layer, inputs, outputs):
            ins, outs = _float_tensors(list(inputs)), _float_tensors(outputs)
            want = str(ins[0].dtype) if ins else f"paddle.{dtype}"
            seen.add(name)
            for o in outs:
                if str(o.dtype) != want:
                    bad.setdefault(name, f"{type(layer).__name__}: in {[str(t.dtype) for t in ins]} -> out {o.dtype}")
        return check

    handles = [layer.register_forward_post_hook(hook(name or "<model>"))
               for name, layer in model.named_sublayers(include_self=True)]
    try:
        if key == "midashenglm":
            base, _, _, clips = _audio_prompt(llm, 40, 3)
            prompts = [{"prompt_token_ids": base, "multimodal_data": {"audio": clips}},
                       {"prompt_token_ids": random_ids(9, 4)}]
        else:
            prompts = [{"prompt_token_ids": random_ids(40, 3)}, {"prompt_token_ids": random_ids(9, 4)}]
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    finally:
        for h in handles:
            h.remove()
    assert len(seen) > 10
    assert not bad, "layers that change the dtype:\n" + "\n".join(f"  {k}: {v}" for k, v in sorted(bad.items()))


# ---------------------------------------------------------------- Triton kernels forced (interpreter, float32)

TRITON_SCRIPT = r"""
import json, sys
from fastdeploy_ext import LLM, SamplingParams
from fastdeploy_ext.layers.linear_attention import LinearAttention
# One sequence of at most 32 tokens: the start-up warm-up prefill is small too (the interpreter is slow).
llm = LLM(model=sys.argv[1], backend="device", dtype="float32", max_model_len=64, max_num_seqs=1,
          max_num_batched_tokens=32)
layers = [l for l in llm.llm_engine.model.sublayers() if isinstance(l, LinearAttention)]
names = sorted({l.impl.prefill_op.__name__ + "/" + l.impl.decode_op.__name__ for l in layers})
prompt = json.loads(sys.argv[2])
out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                   logprobs=2, prompt_logprobs=2), use_tqdm=False)[0]
print("RESULT " + json.dumps({"ops": names, "tokens": out.outputs.token_ids,
      "logprobs": [{str(k): v for k, v in d.items()} for d in out.outputs.logprobs],
      "prompt_logprobs": [None if d is None else {str(k): v for k, v in d.items()} for d in out.prompt_logprobs]}))
"""


@pytest.mark.timeout(360)  # the interpreter subprocess below has its own 300 s bound
def test_triton_kernels_forced_match_hf(model_dirs, tmp_path):
    """Tiny MiniMax-M1 on the device backend with ``FDEXT_LIGHTNING_KERNELS=triton`` (the documented setting,
    fastdeploy_ext/layers/linear_attention.py) under ``TRITON_INTERPRET=1``, in a subprocess (the interpreter must be
    on before Triton compiles anything): the lightning layers run the Triton prefill and decode kernels, and the
    prompt and generated logprobs are within 1e-4 of HF float32."""
    import triton  # noqa: F401
    d = model_dirs["m1_original"]
    prompt = random_ids(30, 61)  # 4 lightning blocks of 8, a multi-chunk Triton prefill
    env = dict(os.environ, TRITON_INTERPRET="1", FDEXT_LIGHTNING_KERNELS="triton", PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", TRITON_SCRIPT, d, json.dumps(prompt)], capture_output=True, text=True,
                          timeout=300, env=env, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))[len("RESULT "):])
    assert got["ops"] == ["prefill_triton/decode_triton"], got["ops"]
    oracle = hf_float64.text_oracle(d, "float32")
    ref = oracle(prompt + got["tokens"])
    worst = 0.0
    for i, entry in enumerate(got["prompt_logprobs"][1:], start=1):
        for t, v in entry.items():
            worst = max(worst, abs(v - float(ref[i - 1][int(t)])))
    for i, (tok, entry) in enumerate(zip(got["tokens"], got["logprobs"])):
        row = ref[len(prompt) - 1 + i]
        assert tok == int(np.argmax(row)) or np.diff(np.sort(row)[-2:])[0] < 1e-4
        for t, v in entry.items():
            worst = max(worst, abs(v - float(row[int(t)])))
    print(f"\nTriton (interpreter) vs HF float32: max |logprob diff| {worst:.3g}")
    assert worst <= 1e-4


# ---------------------------------------------------------------- the lightning kernel dispatch rule

# (capability, q dtype, out dtype, head_dim, block_size, precision, heads, tokens) -> kernel, from the rule's
# documentation (fastdeploy_ext/ops/lightning_attn/triton_kernels.py _default_prefill_config, gluon_kernels.supports).
DISPATCH = [
    ((9, 0), "float32", "float32", 128, 64, "tf32", 64, 32768, "gluon"),
    ((9, 0), "float32", "float32", 128, 64, "tf32", 64, 256, "gluon"),  # many heads: any length
    ((9, 0), "bfloat16", "bfloat16", 128, 64, "tf32", 64, 32768, "gluon"),
    ((9, 0), "bfloat16", "float32", 128, 64, "tf32", 64, 32768, "triton"),  # the bf16 kernel stores bf16 tiles
    ((9, 0), "float32", "float32", 128, 64, "tf32", 8, 16384, "triton"),  # few heads, short: launch cost
    ((9, 0), "float32", "float32", 128, 64, "tf32", 8, 32768, "gluon"),  # few heads from 32768 tokens
    ((9, 0), "bfloat16", "bfloat16", 128, 64, "tf32", 8, 32768, "triton"),  # bf16 few heads stays on Triton
    ((9, 0), "float32", "float32", 128, 64, "ieee", 64, 32768, "triton"),  # Gluon is TF32-only
    ((9, 0), "float32", "float32", 64, 64, "tf32", 64, 32768, "triton"),  # measured shapes only: D = 128
    ((9, 0), "float32", "float32", 128, 128, "tf32", 64, 32768, "triton"),  # ... and 64-token chunks
    ((8, 0), "float32", "float32", 128, 64, "tf32", 64, 32768, "triton"),  # sm_90 only
    ((10, 0), "bfloat16", "bfloat16", 128, 64, "tf32", 64, 32768, "triton"),
    (None, "float32", "float32", 128, 64, "tf32", 64, 32768, "triton"),  # off a GPU (interpreter included)
]


@pytest.mark.parametrize("cap,dtype,out,d,block,precision,heads,tokens,kernel", DISPATCH)
def test_lightning_prefill_dispatch_rule(cap, dtype, out, d, block, precision, heads, tokens, kernel):
    import triton  # noqa: F401
    from fastdeploy_ext.ops.lightning_attn.triton_kernels import prefill_kernel

    assert prefill_kernel(cap, dtype, out, d, block, precision, heads, tokens) == kernel


def test_lightning_capability_comes_from_paddle(monkeypatch):
    """Paddle callers reach the rule with the device's capability (``paddle.device.cuda.get_device_capability`` of
    the tensor's GPU); a CPU tensor, or the interpreter, gives None (so never the Gluon kernels)."""
    import paddle

    from fastdeploy_ext.ops import launch

    class FakePlace:
        def is_gpu_place(self):
            return True

        def gpu_device_id(self):
            return 3

    class FakeGpuTensor:
        place = FakePlace()

    asked = []
    monkeypatch.setattr(paddle.device.cuda, "get_device_capability", lambda i: asked.append(i) or (9, 0))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    ops = launch.PaddleOps()
    assert ops.capability(FakeGpuTensor()) == (9, 0) and asked == [3]
    assert ops.capability(paddle.zeros([1])) is None
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert ops.capability(FakeGpuTensor()) is None


def test_lightning_layer_kernel_choice():
    """The layer's choice, made once at construction: the Triton kernels on a GPU or when forced, the Paddle
    reference otherwise; each with the dtypes it takes (the reference: float32 and float64)."""
    from fastdeploy_ext.ops.lightning_attn.select import select_lightning_ops

    def names(ops):
        return ops[0].__name__, ops[1].__name__, ops[2]

    assert names(select_lightning_ops(8, on_gpu=False)) == ("prefill", "decode", ("float32", "float64"))
    assert names(select_lightning_ops(8, on_gpu=False, kernels="reference")) == ("prefill", "decode", ("float32", "float64"))
    assert names(select_lightning_ops(8, on_gpu=True, kernels="reference"))[2] == ("float32", "float64")
    if importlib_util_find("triton"):
        assert names(select_lightning_ops(8, on_gpu=True)) == ("prefill_triton", "decode_triton", ("float32", "bfloat16"))
        assert names(select_lightning_ops(8, on_gpu=False, kernels="triton"))[:2] == ("prefill_triton", "decode_triton")
    with pytest.raises(ValueError, match="FDEXT_LIGHTNING_KERNELS"):
        select_lightning_ops(8, on_gpu=False, kernels="gluon")


def importlib_util_find(name):
    import importlib.util

    return importlib.util.find_spec(name) is not None
