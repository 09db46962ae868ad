"""Tensor parallelism: tp=2 over gloo equals tp=1 on CPU; the real configs' shard plans are checked on
paper (models under ``paddle.LazyGuard``, checkpoint tensors as zero-stride stand-ins)."""

import json
import os
import re
import signal
import subprocess
import sys

import numpy as np
import pytest

from fastdeploy_ext import LLM, SamplingParams
from fastdeploy_ext.config.base import ConfigError
from fastdeploy_ext.engine.engine import EngineArgs, RankFailure, build_fd_config, build_model
from fastdeploy_ext.layers.utils import shape_only_loading
from fastdeploy_ext.tiny import write_tiny
from tests.oracle import random_prompts as prompts_of

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
M1_DIR = os.path.join(ROOT, "configs", "models", "MiniMax-M1")
M1_INDEX = os.path.join(M1_DIR, "model.safetensors.index.json")



LENGTHS = [3, 70, 1, 41, 12, 90]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=4 + 3 * i, ignore_eos=True, logprobs=2) for i in range(len(LENGTHS))]
# Chunked prefill (budget 32 tokens), queueing (3 seats) and preemption (16 pages of 8 tokens).
ENGINE = dict(max_model_len=256, max_num_seqs=3, max_num_batched_tokens=32, num_kv_blocks=16, block_size=8)


@pytest.fixture(scope="module", params=["Qwen2ForCausalLM", "MiniMaxM1ForCausalLM"])
def tiny_model(request, tmp_path_factory):
    d = str(tmp_path_factory.mktemp(request.param))
    write_tiny(request.param, d, seed=7)
    return d


def run(model_dir, tp, **extra):
    with LLM(model=model_dir, tensor_parallel_size=tp, **ENGINE, **extra) as llm:
        outs = llm.generate(prompts_of(LENGTHS, 401), PARAMS, use_tqdm=False)
        stats = llm.llm_engine.scheduler.stats
        # n = 2 forks sibling 1 from sibling 0's prefill: every rank copies its KV shard and state.
        outs += llm.generate(prompts_of([20], 404), SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=6,
                                                                   ignore_eos=True, logprobs=1), use_tqdm=False)
        assert llm.llm_engine.scheduler.stats.num_forks == 1
        return outs, stats


def test_tp2_equals_tp1(tiny_model):
    ref, stats1 = run(tiny_model, 1)
    got, stats2 = run(tiny_model, 2)
    assert stats2.num_preemptions > 0 and stats2.num_chunked_prefill_steps > 0 and stats2.num_mixed_steps > 0
    assert stats1 == stats2
    for a, b in zip(got, ref):
        assert a.outputs.token_ids == b.outputs.token_ids
        for x, y in zip(a.outputs.logprobs, b.outputs.logprobs):
            assert x.keys() == y.keys() and max(abs(x[t] - y[t]) for t in x) <= 1e-5


@pytest.mark.timeout(240)  # the launch below has its own 180 s bound
def test_paddle_distributed_launch(tiny_qwen2_dir, tmp_path):
    """``python -m paddle.distributed.launch --nproc_per_node 2`` runs the same script on both ranks."""
    script = tmp_path / "run.py"
    script.write_text(
        "import json, sys\n"
        "from fastdeploy_ext import LLM, SamplingParams\n"
        "llm = LLM(model=sys.argv[1], max_model_len=128, tensor_parallel_size=2)\n"
        "prompts = json.loads(sys.argv[2])\n"
        "outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)\n"
        "llm.shutdown()\n"
        "print('RESULT', json.dumps([o.outputs.token_ids for o in outs]))\n"
    )
    prompts = prompts_of([5, 33, 2], 402)
    cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "2", "--log_dir",
           str(tmp_path / "log"), str(script), tiny_qwen2_dir, json.dumps(prompts)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT"))
    ref = LLM(model=tiny_qwen2_dir, max_model_len=128).generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert json.loads(line.split(" ", 1)[1]) == [o.outputs.token_ids for o in ref]


def test_bad_tp_fails_before_any_process_starts(tmp_path, monkeypatch):
    def no_spawn(*a, **k):
        raise AssertionError("a rank process was started")

    d = str(tmp_path / "q")
    write_tiny("Qwen2ForCausalLM", d, seed=2, vocab_size=516)  # 516 = 3 * 172: the heads are what fails
    monkeypatch.setattr(subprocess, "Popen", no_spawn)
    with pytest.raises(ConfigError, match=r"self_attn\.qkv_proj: num_heads / tensor_parallel_size: 4 is not divisible by 3"):
        LLM(model=d, tensor_parallel_size=3)
    with pytest.raises(ConfigError, match="vocab_size / tensor_parallel_size: 516 is not divisible by 8"):
        LLM(model=d, tensor_parallel_size=8)
    with pytest.raises(ConfigError, match="tensor_parallel_size must be >= 1, got 0"):
        LLM(model=d, tensor_parallel_size=0)


def test_bad_tp_for_experts_and_kv_heads(tmp_path, monkeypatch):
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: (_ for _ in ()).throw(AssertionError("spawned")))
    d = str(tmp_path / "m")
    write_tiny("MiniMaxM1ForCausalLM", d, seed=1)
    cfg = json.load(open(os.path.join(d, "config.json")))
    cfg["intermediate_size"] = 30  # not divisible by tp=4
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    with pytest.raises(ConfigError, match="intermediate"):
        LLM(model=d, tensor_parallel_size=4)
    cfg["intermediate_size"] = 32
    cfg["num_key_value_heads"] = 2  # 4 heads, 2 kv heads: tp=4 replicates kv; tp=8 cannot split 4 q heads
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        LLM(model=d, tensor_parallel_size=8)


def process_gone(pid: int) -> bool:
    """Exited: no /proc entry, or a zombie not yet reaped by the rank group's reaper."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def test_dead_rank_is_reported(tiny_qwen2_dir):
    llm = LLM(model=tiny_qwen2_dir, max_model_len=128, tensor_parallel_size=2)
    runner = llm.llm_engine.runner
    os.kill(runner.rank_pids[1], signal.SIGKILL)
    with pytest.raises(RankFailure, match="rank 1") as failure:
        llm.generate(prompts_of([9], 403), SamplingParams(max_tokens=4), use_tqdm=False)
    # the message carries the rank's last log lines (one line on the CLI, no log to open)
    assert "its log ends: " in str(failure.value) and "\n" not in str(failure.value).split("its log ends: ")[1]
    assert all(process_gone(pid) for pid in runner.rank_pids.values())
    # The logs the error names stay behind after a failure.
    assert os.path.exists(os.path.join(runner.log_dir, "workerlog.1"))


class ShapeOnly:
    """A checkpoint tensor known only by its shape: slices are zero-stride views (no memory), and
    the elements read are counted (a rank must read only its shard)."""

    def __init__(self, shape):
        self.shape = tuple(shape)
        self.read = 0

    def __getitem__(self, idx):
        view = np.broadcast_to(np.float32(0), self.shape)[idx]
        self.read += view.size
        return view

    def materialize(self):
        return self[...]


def m1_shapes(cfg, names):
    """Shapes of the original M1 checkpoint per minimax_m1.md §2."""
    h, heads, kv, d, inter = (cfg[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                                 "head_dim", "intermediate_size"))
    table = [
        (r"model\.embed_tokens\.weight|lm_head\.weight", (cfg["vocab_size"], h)),
        (r".*(input_layernorm|post_attention_layernorm)\.weight|model\.norm\.weight", (h,)),
        (r".*self_attn\.qkv_proj\.weight", (3 * heads * d, h)),
        (r".*self_attn\.output_gate\.weight", (heads * d, h)),
        (r".*self_attn\.out_proj\.weight", (h, heads * d)),
        (r".*self_attn\.norm\.weight", (heads * d,)),
        (r".*self_attn\.q_proj\.weight", (heads * d, h)),
        (r".*self_attn\.[kv]_proj\.weight", (kv * d, h)),
        (r".*self_attn\.o_proj\.weight", (h, heads * d)),
        (r".*block_sparse_moe\.gate\.weight", (cfg["num_local_experts"], h)),
        (r".*experts\.\d+\.w[13]\.weight", (inter, h)),
        (r".*experts\.\d+\.w2\.weight", (h, inter)),
    ]
    out = {}
    for n in names:
        out[n] = next(shape for pat, shape in table if re.fullmatch(pat, n))
    return out


REPLICATED = re.compile(r".*(layernorm|model\.norm|block_sparse_moe\.gate)\.weight")


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_minimax_m1_shard_plan(tp):
    """Every rank's parameters are filled from exactly its slice of the real index's tensors."""
    cfg = json.load(open(os.path.join(M1_DIR, "config.json")))
    names = list(json.load(open(M1_INDEX))["weight_map"])
    shapes = m1_shapes(cfg, names)
    elems = sum(int(np.prod(s)) for s in shapes.values())
    router = sum(int(np.prod(s)) for n, s in shapes.items() if n.endswith("block_sparse_moe.gate.weight"))
    # The index's byte total matches the table with every tensor bf16 except the routers, stored fp32.
    assert 2 * elems + 2 * router == json.load(open(M1_INDEX))["metadata"]["total_size"]
    for rank in sorted({0, tp - 1}):
        model_cls, fd_config = build_fd_config(EngineArgs(model=M1_DIR, tensor_parallel_size=tp), rank=rank)
        model = build_model(model_cls, fd_config, load=False)
        tensors = {n: ShapeOnly(s) for n, s in shapes.items()}
        with shape_only_loading(model):
            loaded = model.load_weights(iter(tensors.items()))
        assert set(loaded) == set(names)
        for n, t in tensors.items():
            full = int(np.prod(t.shape))
            kv_replicated = re.fullmatch(r".*self_attn\.[kv]_proj\.weight", n) and tp > cfg["num_key_value_heads"]
            want = full if REPLICATED.fullmatch(n) else full * max(1, tp // cfg["num_key_value_heads"]) // tp if kv_replicated else full // tp
            assert t.read == want, f"rank {rank} read {t.read} of {n} ({full}), expected {want}"
        rank_elems = sum(int(np.prod(p.shape)) for p in model.parameters())
        replicated = sum(int(np.prod(s)) for n, s in shapes.items() if REPLICATED.fullmatch(n))
        assert rank_elems == (elems - replicated) // tp + replicated
        if tp == 8:
            # minimax_m1.md §8: ≈114 GB of bf16 weights per rank at tp=8.
            assert abs(2 * rank_elems / 1e9 - 114.0) < 0.1


MIDASHENG_DIR = os.path.join(ROOT, "configs", "models", "MiDashengLM-7B")


def midashenglm_shapes(cfg):
    """Checkpoint names and shapes of MiDashengLM-7B per midashenglm.md §1 and §7."""
    enc, text = cfg["audio_encoder_config"], cfg["text_config"]
    e, depth, hidden, inter = enc["embed_dim"], enc["depth"], text["hidden_size"], text["intermediate_size"]
    d = text["head_dim"]
    q, kv, vocab = text["num_attention_heads"] * d, text["num_key_value_heads"] * d, text["vocab_size"]
    t = {f"audio_encoder.init_bn.{k}": (64,) for k in ("weight", "bias", "running_mean", "running_var")}
    t["audio_encoder.init_bn.num_batches_tracked"] = ()
    t.update({"audio_encoder.patch_embed.proj.weight": (e, 1, 64, 4), "audio_encoder.patch_embed.proj.bias": (e,),
              "audio_encoder.time_pos_embed": (1, e, 1, enc["target_length"] // 4),
              "audio_encoder.freq_pos_embed": (1, e, 1, 1),
              "audio_encoder.norm.weight": (e,), "audio_encoder.norm.bias": (e,)})
    for i in range(depth):
        p = f"audio_encoder.blocks.{i}"
        for n in ("norm1", "norm2"):
            t[f"{p}.{n}.weight"] = t[f"{p}.{n}.bias"] = (e,)
        t.update({f"{p}.attn.qkv.weight": (3 * e, e), f"{p}.attn.qkv.bias": (3 * e,), f"{p}.attn.proj.weight": (e, e),
                  f"{p}.attn.proj.bias": (e,), f"{p}.mlp.fc1.weight": (4 * e, e), f"{p}.mlp.fc1.bias": (4 * e,),
                  f"{p}.mlp.fc2.weight": (e, 4 * e), f"{p}.mlp.fc2.bias": (e,)})
    k = cfg["subsample_factor"]
    t.update({"audio_projector.net.0.weight": (hidden, e * k), "audio_projector.net.0.bias": (hidden,),
              "audio_projector.net.2.weight": (hidden, hidden), "audio_projector.net.2.bias": (hidden,),
              "decoder.model.embed_tokens.weight": (vocab, hidden), "decoder.model.norm.weight": (hidden,),
              "decoder.lm_head.weight": (vocab, hidden)})
    for i in range(text["num_hidden_layers"]):
        p = f"decoder.model.layers.{i}"
        t.update({f"{p}.self_attn.q_proj.weight": (q, hidden), f"{p}.self_attn.q_proj.bias": (q,),
                  f"{p}.self_attn.k_proj.weight": (kv, hidden), f"{p}.self_attn.k_proj.bias": (kv,),
                  f"{p}.self_attn.v_proj.weight": (kv, hidden), f"{p}.self_attn.v_proj.bias": (kv,),
                  f"{p}.self_attn.o_proj.weight": (hidden, q), f"{p}.mlp.gate_proj.weight": (inter, hidden),
                  f"{p}.mlp.up_proj.weight": (inter, hidden), f"{p}.mlp.down_proj.weight": (hidden, inter),
                  f"{p}.input_layernorm.weight": (hidden,), f"{p}.post_attention_layernorm.weight": (hidden,)})
    return t


# Replicated on every rank: norms, BatchNorm, patch embedding, position embeddings, and the biases of
# row-parallel layers (added once, after the all-reduce).
MIDASHENG_REPLICATED = re.compile(
    r".*(norm\d?\.(weight|bias)|layernorm\.weight|init_bn\..*|patch_embed\..*|pos_embed|attn\.proj\.bias|"
    r"mlp\.fc2\.bias|net\.2\.bias)")


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_midashenglm_7b_shard_plan(tp):
    cfg = json.load(open(os.path.join(MIDASHENG_DIR, "config.json")))
    shapes = midashenglm_shapes(cfg)
    for rank in sorted({0, tp - 1}):
        model_cls, fd_config = build_fd_config(EngineArgs(model=MIDASHENG_DIR, tensor_parallel_size=tp), rank=rank)
        model = build_model(model_cls, fd_config, load=False)
        tensors = {n: ShapeOnly(s) for n, s in shapes.items()}
        with shape_only_loading(model):
            model.load_weights(iter(tensors.items()))
        for n, t in tensors.items():
            if n.endswith("num_batches_tracked"):
                continue  # ignored by design (BatchNorm's step counter)
            full = int(np.prod(t.shape))
            want = full if MIDASHENG_REPLICATED.fullmatch(n) else full // tp
            assert t.read == want, f"rank {rank} read {t.read} of {n} ({full}), expected {want}"


def test_midashenglm_7b_refuses_tp8():
    with pytest.raises(ConfigError, match="28 is not divisible by 8"):
        build_model(*build_fd_config(EngineArgs(model=MIDASHENG_DIR, tensor_parallel_size=8)), load=False)


def test_midashenglm_tp2_equals_tp1(tmp_path):
    sys.path.insert(0, ROOT)
    from tests.models.test_midashenglm import chat_prompt, clip

    d = str(tmp_path / "mdl")
    write_tiny("MiDashengLMModel", d, seed=3)
    requests = [{"prompt": chat_prompt(), "multimodal_data": {"audio": [clip(2.3, 30)]}},
                {"prompt_token_ids": prompts_of([17], 405, vocab=300)[0]["prompt_token_ids"]},
                {"prompt": chat_prompt(2), "multimodal_data": {"audio": [clip(1.0, 31), clip(0.6, 32)]}}]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=2) for n in (12, 4, 9)]
    outs = {}
    for tp in (1, 2):
        # A 16-token budget splits the audio spans across prefill chunks; 12 pages of 8 tokens cannot hold
        # all three requests, so one is preempted and recomputed (its audio rows reused, not re-encoded).
        with LLM(model=d, tensor_parallel_size=tp, max_model_len=256, max_num_batched_tokens=16, block_size=8,
                 num_kv_blocks=12) as llm:
            outs[tp] = llm.generate(requests, params, use_tqdm=False)
            stats = llm.llm_engine.scheduler.stats
            assert stats.num_chunked_prefill_steps > 0 and stats.num_preemptions > 0 and stats.num_mixed_steps > 0
    for a, b in zip(outs[2], outs[1]):
        assert a.outputs.token_ids == b.outputs.token_ids
        for x, y in zip(a.outputs.logprobs, b.outputs.logprobs):
            assert max(abs(x[t] - y[t]) for t in x) <= 1e-5


def test_wint8_tp2_equals_tp1(tmp_path):
    """Weight-only int8 under tensor parallelism: each rank holds its slice of the tp=1 codes and scales."""
    d = str(tmp_path / "m1")
    write_tiny("MiniMaxM1ForCausalLM", d, seed=9)
    prompts, params = prompts_of([30, 7], 406), SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=2)
    outs = {}
    for tp in (1, 2):
        with LLM(model=d, tensor_parallel_size=tp, max_model_len=128, quantization="wint8") as llm:
            outs[tp] = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(outs[2], outs[1]):
        assert a.outputs.token_ids == b.outputs.token_ids
        for x, y in zip(a.outputs.logprobs, b.outputs.logprobs):
            assert max(abs(x[t] - y[t]) for t in x) <= 1e-5
