"""The engine on the device backend (``backend="device"``), float32 and float64, on tiny MiniMax-M1 (issue 15):
chunked prefill with preemption and mixed steps, an ``n > 1`` fork, tp=2, and wint8/wint4 — each once per dtype,
each against a reference (the HF oracle of tests/hf_float64.py, or for weight-only the float model of the dequantized
weights, as tests/quantization/test_weight_only.py) — and the host-sync counter (tests/sync_counter.py): syncs per
engine step have a fixed bound for prefill-only, decode-only and mixed steps, equal for 2- and 8-layer Qwen2 and
MiniMax-M1.

Tolerances: vs the oracle 1e-4 (float32) / 1e-9 (float64), as tests/models/test_device_backend.py; quantized vs
dequantized float model 1e-5 (float32, tests/quantization's budget) / 1e-9 (float64, against the HF float64 oracle of
the exact dequantized weights).
"""

import numpy as np
import pytest

from fastdeploy_ext import LLM, SamplingParams
from fastdeploy_ext.tiny import write_tiny
from tests.oracle import check_outputs_against_oracle, mixed_workload, random_prompts
from tests.sync_counter import SyncCounter, count_engine_steps

DTYPES = ["float32", "float64"]
ATOL = {"float32": 1e-4, "float64": 1e-9}
QUANT_ATOL = {"float32": 1e-5, "float64": 1e-9}
DEVICE = dict(backend="device")


@pytest.fixture(scope="module")
def m1_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("dev_m1"))
    write_tiny("MiniMaxM1ForCausalLM", d, seed=0)
    return d


@pytest.fixture(scope="module")
def oracles(m1_dir):
    import torch  # noqa: F401
    import transformers  # noqa: F401
    from tests.hf_float64 import text_oracle

    return {dt: text_oracle(m1_dir, dt) for dt in DTYPES}


# ---------------------------------------------------------------- scheduling features vs the oracle


@pytest.mark.parametrize("dtype", DTYPES)
def test_chunked_prefill_preemption_and_mixed_steps_match_oracle(m1_dir, oracles, dtype):
    """The 12-prompt mixed workload (tests/oracle.py) with a 32-token budget (chunked prefills, mixed steps) and 45
    pages of 4 tokens (preemption by recompute, re-zeroed state slots): every greedy token and logprob vs the oracle
    teacher-forced on the output."""
    llm = LLM(model=m1_dir, dtype=dtype, max_model_len=256, max_num_seqs=12, max_num_batched_tokens=32,
              num_kv_blocks=45, block_size=4, **DEVICE)
    prompts, params = mixed_workload()
    outs = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.llm_engine.scheduler.stats
    assert stats.num_chunked_prefill_steps > 0 and stats.num_preemptions > 0 and stats.num_mixed_steps > 0
    assert all(o.outputs.finish_reason == "length" for o in outs)
    worst, ties = check_outputs_against_oracle(outs, oracles[dtype], ATOL[dtype])
    print(f"\n{dtype}: max |logprob diff| {worst:.3g}, {ties} near-ties")
    assert llm.llm_engine.block_manager.num_used == 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_n_samples_fork_matches_single_runs_and_oracle(m1_dir, oracles, dtype):
    """n=3 with free seats: siblings 1, 2 are forked from sibling 0's prefill (KV pages and state copied); each equals
    a single run with seed + k, and its sampled tokens' logprobs match the oracle on its own sequence."""
    llm = LLM(model=m1_dir, dtype=dtype, max_model_len=256, max_num_seqs=4, **DEVICE)
    prompt = random_prompts([25], 305)[0]
    params = SamplingParams(n=3, temperature=1.0, seed=70, max_tokens=10, ignore_eos=True, logprobs=1)
    outs = llm.generate(prompt, params, use_tqdm=False)
    assert llm.llm_engine.scheduler.stats.num_forks == 2
    for k, o in enumerate(outs):
        single = llm.generate(prompt, params.clone(n=1, seed=70 + k), use_tqdm=False)[0]
        assert o.outputs.token_ids == single.outputs.token_ids
    assert len({tuple(o.outputs.token_ids) for o in outs}) == 3
    check_outputs_against_oracle(outs, oracles[dtype], ATOL[dtype], greedy=False)


TP_LENGTHS = [3, 70, 1, 41, 12, 90]


@pytest.mark.parametrize("dtype", DTYPES)
def test_tp2_matches_oracle(m1_dir, oracles, dtype):
    """tp=2 over gloo on the device backend, with chunking (32-token budget), queueing (3 seats) and preemption
    (16 pages of 8): tokens and logprobs vs the oracle."""
    params = [SamplingParams(temperature=0.0, max_tokens=4 + 3 * i, ignore_eos=True, logprobs=2)
              for i in range(len(TP_LENGTHS))]
    with LLM(model=m1_dir, dtype=dtype, tensor_parallel_size=2, max_model_len=256, max_num_seqs=3,
             max_num_batched_tokens=32, num_kv_blocks=16, block_size=8, **DEVICE) as llm:
        assert llm.llm_engine.fd_config.load_config.backend == "device"
        outs = llm.generate(random_prompts(TP_LENGTHS, 401), params, use_tqdm=False)
        stats = llm.llm_engine.scheduler.stats
    assert stats.num_preemptions > 0 and stats.num_chunked_prefill_steps > 0
    worst, _ = check_outputs_against_oracle(outs, oracles[dtype], ATOL[dtype])
    print(f"\ntp=2 {dtype}: max |logprob diff| {worst:.3g}")


def reference_dequantize_float64(w: np.ndarray, group, qmax: int) -> np.ndarray:
    """tests/quantization/test_weight_only.py's ``reference_dequantize`` (the format's definition: float32
    ``s = absmax / qmax`` per output channel or group, ``q = rint(w / s)``) with the product ``q * s`` taken in float64,
    exactly: what a float64 model dequantizes to."""
    o, i = w.shape
    g = i if group is None else group
    blocks = w.reshape(o, i // g, g)
    amax = np.max(np.abs(blocks), axis=2, keepdims=True)
    scale = np.where(amax > 0, amax / np.float32(qmax), np.float32(1)).astype(np.float32)
    q = np.clip(np.rint(blocks / scale), -qmax, qmax)
    return (q.astype(np.float64) * scale.astype(np.float64)).reshape(o, i)


@pytest.mark.parametrize("method", ["wint8", "wint4"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_weight_only_equals_float_model_of_dequantized_weights(m1_dir, tmp_path, dtype, method):
    """The quantized model vs a float model holding the dequantized weights. float32: the package's float model of a
    float32 checkpoint of them, as tests/quantization (1e-5). float64: the package loads checkpoints through float32,
    which would round ``q * s``, so the float model is the HF float64 oracle of a float64 checkpoint (1e-9)."""
    from safetensors.numpy import save_file

    from tests.quantization.helpers import (
        DECODER_LINEAR,
        copy_side_files,
        max_logprob_diff,
        prompt_ids,
        prompt_logprobs,
        read_tensors,
        write_float_checkpoint,
    )
    from tests.quantization.test_weight_only import METHODS, reference_dequantize

    quantization, group, qmax = METHODS[method]
    tensors = read_tensors(m1_dir)
    assert sum(1 for k in tensors if DECODER_LINEAR.match(k)) >= 8
    ids = prompt_ids(7)
    q_llm = LLM(model=m1_dir, dtype=dtype, max_model_len=512, quantization=quantization, **DEVICE)
    got = prompt_logprobs(q_llm, ids)
    if dtype == "float32":
        deq = {k: reference_dequantize(v, group, qmax) if DECODER_LINEAR.match(k) else v for k, v in tensors.items()}
        write_float_checkpoint(m1_dir, str(tmp_path), deq)
        want = prompt_logprobs(LLM(model=str(tmp_path), dtype=dtype, max_model_len=512, **DEVICE), ids)
        diff = max_logprob_diff(got, want)
    else:
        import transformers  # noqa: F401
        from tests.hf_float64 import text_oracle

        deq = {k: reference_dequantize_float64(v, group, qmax) if DECODER_LINEAR.match(k) else v.astype(np.float64)
               for k, v in tensors.items()}
        copy_side_files(m1_dir, str(tmp_path))
        save_file(deq, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
        ref = text_oracle(str(tmp_path), "float64")(ids)
        diff = max(abs(v - float(ref[i][t])) for i, entry in enumerate(got) for t, v in entry.items())
    print(f"\n{method} {dtype}: max |logprob quantized - dequantized float model| = {diff:.3g}")
    assert diff <= QUANT_ATOL[dtype]


# ---------------------------------------------------------------- host syncs per step

# Per step the runner copies the sampled rows' logits to the host once; a few more for step-level metadata would be
# fine. Anything per layer or per sequence is not: 2- and 8-layer models must count the same.
MAX_SYNCS_PER_STEP = 4


def _sync_dirs(tmp_path_factory):
    dirs = {}
    for arch, layers, extra in (("Qwen2ForCausalLM", 2, {}), ("Qwen2ForCausalLM", 8, {}),
                                # [linear, full] and [linear x3, full] x 2: both layer types in each
                                ("MiniMaxM1ForCausalLM", 2, {"full_every": 2}), ("MiniMaxM1ForCausalLM", 8, {})):
        d = str(tmp_path_factory.mktemp(f"sync_{arch}_{layers}"))
        write_tiny(arch, d, seed=1, num_hidden_layers=layers, **extra)
        dirs[(arch, layers)] = d
    return dirs


@pytest.fixture(scope="module")
def sync_dirs(tmp_path_factory):
    return _sync_dirs(tmp_path_factory)


def _drive(engine):
    """Step 1 prefills two prompts; then decodes; a third prompt arrives beside them (a mixed step) and is chunked
    over two steps (16-token budget: a prefill chunk beside decodes, then its last chunk); then decodes only."""
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)
    prompts = random_prompts([5, 9, 20], 77)
    engine.add_request("a", None, prompts[0]["prompt_token_ids"], params)
    engine.add_request("b", None, prompts[1]["prompt_token_ids"], params)
    engine.step()
    engine.step()
    engine.add_request("c", None, prompts[2]["prompt_token_ids"], params)
    while engine.has_unfinished_requests():
        engine.step()


def _count(model_dir, dtype="float32"):
    llm = LLM(model=model_dir, dtype=dtype, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=16, **DEVICE)
    with SyncCounter() as counter:
        return count_engine_steps(llm.llm_engine, counter, _drive)


def _describe(records):
    lines = []
    for i, r in enumerate(records):
        where = ", ".join(f"{n}@{w} x{c}" for (n, w), c in sorted(r["calls"].items()))
        lines.append(f"  step {i} {r['kind']}: {r['syncs']} [{where}]")
    return "\n".join(lines)


@pytest.mark.parametrize("arch", ["Qwen2ForCausalLM", "MiniMaxM1ForCausalLM"])
def test_host_syncs_per_step_are_bounded_and_independent_of_depth(sync_dirs, arch):
    shallow, deep = _count(sync_dirs[(arch, 2)]), _count(sync_dirs[(arch, 8)])
    report = f"2 layers:\n{_describe(shallow)}\n8 layers:\n{_describe(deep)}"
    print("\n" + report)
    kinds = [r["kind"] for r in shallow]
    assert kinds == [r["kind"] for r in deep]
    assert {"prefill", "decode", "mixed"} <= set(kinds), kinds
    assert [r["syncs"] for r in shallow] == [r["syncs"] for r in deep], report
    for kind in ("prefill", "decode", "mixed"):
        counts = {r["syncs"] for r in shallow + deep if r["kind"] == kind}
        assert max(counts) <= MAX_SYNCS_PER_STEP, f"{kind} steps: {sorted(counts)} syncs\n{report}"


def test_sync_counter_counts_each_kind_once():
    """The counter itself: every listed method counts, nested calls once (tolist -> numpy), nothing after exit."""
    import paddle

    x, s = paddle.arange(4, dtype="float32"), paddle.to_tensor(2.0)
    with SyncCounter() as c:
        x.numpy()
        x.tolist()
        np.asarray(x)
        s.item()
        float(s)
        int(s)
        bool(s > 0)
        [0, 1, 2][paddle.to_tensor(1)]
        x.cpu()
        paddle.utils.dlpack.to_dlpack(x)
        np.from_dlpack(x)
    names = [n for n, _ in c.calls]
    assert sorted(names) == sorted(["numpy", "tolist", "__array__", "item", "__float__", "__int__", "__bool__",
                                    "__index__", "cpu", "to_dlpack", "__dlpack__"]), names
    x.numpy()
    assert len(c.calls) == len(names)


def test_sync_counter_sees_per_layer_syncs(sync_dirs):
    """The same drive on the host backend (NumPy views of every layer's tensors) counts more syncs per step for 8
    layers than for 2: the counter can see a per-layer sync."""
    def count(d):
        llm = LLM(model=d, backend="host", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=16)
        with SyncCounter() as counter:
            return [r["syncs"] for r in count_engine_steps(llm.llm_engine, counter, _drive)]

    shallow, deep = (count(sync_dirs[("MiniMaxM1ForCausalLM", n)]) for n in (2, 8))
    assert len(shallow) == len(deep) and all(b > a for a, b in zip(shallow, deep)), (shallow, deep)
