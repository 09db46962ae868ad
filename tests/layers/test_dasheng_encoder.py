"""Dasheng encoder and projector vs the PyPI ``dasheng`` package (torch) with shared tiny random weights.

Both sides get the same log-mel features from our frontend; ``dasheng`` is used with B = 1 only (its batch-global
top_db and padded-True mask polarity make batched outputs incomparable). Tolerance: fp32 relative error 1e-5
(max |diff| / max |ref|) for a 2-block encoder, i.e. ~10 ops at ~1e-6 each.

``dasheng`` 0.0.9 pulls torchaudio 2.11.1, a CUDA build whose compiled extension cannot load next to torch
2.13+cpu; :func:`import_dasheng` applies the documented workaround (remove the unloadable extension libraries so
torchaudio runs pure-Python) and skips when ``dasheng`` is not installed (``pip install dasheng``).
"""


import numpy as np
import paddle
import pytest
import torch

from fastdeploy_ext.config.base import ConfigError
from fastdeploy_ext.config.dasheng import DashengConfig
from fastdeploy_ext.layers.audio.dasheng import AudioProjectorSubsample, DashengAttention, DashengAudioEncoder
from fastdeploy_ext.layers.audio.frontend import log_mel_spectrogram
from fastdeploy_ext.layers.utils import WeightLoadError
from fastdeploy_ext.models.midashenglm.config import MiDashengLMConfig
from tests.torchaudio_fix import fix_torchaudio

SR = 16000
REL_TOL = 1e-5
TINY = dict(embed_dim=64, depth=2, num_heads=4, patch_size=[64, 4], patch_stride=[64, 4], target_length=64, qkv_bias=True)


def import_dasheng():
    """``dasheng.pretrained.pretrained`` with the torchaudio workaround. The test extra installs dasheng and
    torchaudio: a missing one is a failed install and fails the test, never a skip."""
    fix_torchaudio()
    from dasheng.pretrained import pretrained

    return pretrained


@pytest.fixture(scope="module")
def dasheng_pretrained():
    return import_dasheng()


def make_reference(pretrained, seed: int) -> torch.nn.Module:
    """Tiny ``dasheng.Dasheng`` with every tensor randomised (norm affines and BatchNorm statistics included)."""
    torch.manual_seed(seed)
    model = pretrained.Dasheng(**{k: tuple(v) if isinstance(v, list) else v for k, v in TINY.items()}).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
        bn = model.init_bn[1]
        bn.running_mean.copy_(torch.empty(64).uniform_(-60.0, -10.0))
        bn.running_var.copy_(torch.empty(64).uniform_(100.0, 900.0))
    return model


def checkpoint_name_to_param(name: str):
    """Checkpoint name (without ``audio_encoder.``) -> encoder parameter name; None for ignored buffers."""
    if name.startswith("front_end.") or name.endswith("num_batches_tracked"):
        return None
    name = name.replace("init_bn.1.", "init_bn.")
    return name.replace("running_mean", "_mean").replace("running_var", "_variance")


def load_from_torch(encoder: DashengAudioEncoder, reference: torch.nn.Module) -> None:
    params = dict(encoder.named_parameters())
    used = set()
    for name, tensor in reference.state_dict().items():
        target = checkpoint_name_to_param(name)
        if target is None:
            continue
        param = params[target]
        param.weight_loader(param, tensor.detach().numpy())
        used.add(target)
    assert used == set(params), f"parameters never loaded: {sorted(set(params) - used)}"


def build_pair(pretrained, seed):
    reference = make_reference(pretrained, seed)
    encoder = DashengAudioEncoder(None, "audio_encoder", DashengConfig.from_hf_config(TINY))
    load_from_torch(encoder, reference)
    return encoder, reference


def reference_forward(reference, features: np.ndarray, num_samples: int) -> np.ndarray:
    with torch.no_grad():
        x = reference.init_bn(torch.from_numpy(features)[:, None])
        return reference.forward_spectrogram(x, x_length=torch.tensor([num_samples])).numpy()


def rel_err(ours, ref) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def waveform(num_samples, seed):
    rng = np.random.default_rng(seed)
    t = np.arange(num_samples) / SR
    tone = 0.3 * np.sin(2 * np.pi * (200 + 1500 * t) * t)
    return (tone + 0.05 * rng.standard_normal(num_samples)).astype(np.float32)


# target_length 64 -> 16-patch chunks. 1 s: 25 patches (one full chunk + a tail); 3 s: 75 patches (4 full chunks +
# a tail), the tiny-scale image of a 25 s clip; 2.83 s: L mod 640 >= 480, the last patch is a query but not a key.
LENGTHS = {"1s": SR, "2.83s_quirk": 640 * 70 + 500, "3s": 3 * SR}
SEEDS = {"seed0": 0, "seed1": 1, "seed2": 1234}


@pytest.mark.parametrize("seed", list(SEEDS.values()), ids=list(SEEDS))
@pytest.mark.parametrize("num_samples", list(LENGTHS.values()), ids=list(LENGTHS))
def test_encoder_matches_dasheng(dasheng_pretrained, seed, num_samples):
    encoder, reference = build_pair(dasheng_pretrained, seed)
    features = log_mel_spectrogram(waveform(num_samples, seed)[None])
    ours, keep = encoder(features, [num_samples])
    ref = reference_forward(reference, features.numpy(), num_samples)
    num_patches = (1 + num_samples // 160) // 4
    assert ours.shape == [1, num_patches, 64] and ref.shape == (1, num_patches, 64)
    assert keep.numpy().sum() == num_samples // 640
    assert rel_err(ours.numpy(), ref) <= REL_TOL


def test_encoder_without_lengths_matches_dasheng(dasheng_pretrained):
    encoder, reference = build_pair(dasheng_pretrained, 7)
    features = log_mel_spectrogram(waveform(2 * SR, 7)[None])
    ours, keep = encoder(features)
    with torch.no_grad():
        ref = reference.forward_spectrogram(reference.init_bn(torch.from_numpy(features.numpy())[:, None])).numpy()
    assert keep is None
    assert rel_err(ours.numpy(), ref) <= REL_TOL


def test_quirk_patch_alone_in_last_chunk(dasheng_pretrained):
    # 65 patches, 64 keys: the last chunk holds one query with no valid key. Its attention output is defined as 0
    # (dasheng returns mean(V) there); every other patch must still match.
    num_samples = 640 * 64 + 480
    encoder, reference = build_pair(dasheng_pretrained, 3)
    features = log_mel_spectrogram(waveform(num_samples, 3)[None])
    ours, keep = encoder(features, [num_samples])
    ours = ours.numpy()
    ref = reference_forward(reference, features.numpy(), num_samples)
    assert ours.shape[1] == 65 and not keep.numpy()[0, 64]
    assert np.isfinite(ours).all()
    assert rel_err(ours[:, :64], ref[:, :64]) <= REL_TOL


def test_padded_batch_matches_single_clip(dasheng_pretrained):
    encoder, _ = build_pair(dasheng_pretrained, 11)
    # 1.1 s = 27 patches: its second chunk (11 patches) shares a 16-patch window with 5 padding patches.
    short, long = waveform(int(1.1 * SR), 1), waveform(3 * SR, 2)
    padded = np.zeros([2, long.shape[0]], np.float32)
    padded[0, : short.shape[0]] = short
    padded[1] = long
    lengths = [short.shape[0], long.shape[0]]
    features = log_mel_spectrogram(padded, lengths)
    batched, _ = encoder(features, lengths)
    alone, _ = encoder(log_mel_spectrogram(short[None]), [short.shape[0]])
    valid = alone.shape[1]
    assert rel_err(batched.numpy()[0, :valid], alone.numpy()[0]) <= REL_TOL
    long_alone, _ = encoder(log_mel_spectrogram(long[None]), [long.shape[0]])
    assert rel_err(batched.numpy()[1], long_alone.numpy()[0]) <= REL_TOL
    # Without the key mask the short clip attends to its padding: the comparison above would fail.
    unmasked, _ = encoder(features)
    assert rel_err(unmasked.numpy()[0, :valid], alone.numpy()[0]) > 1e-2


def test_fully_masked_rows_are_zero_like_torch_sdpa():
    config = DashengConfig.from_hf_config(TINY)
    attn = DashengAttention(None, "audio_encoder.blocks.0.attn", config)
    rng = np.random.default_rng(5)
    qkv_w = rng.standard_normal([192, 64]).astype(np.float32) * 0.2
    qkv_b = rng.standard_normal([192]).astype(np.float32) * 0.1
    proj_w = rng.standard_normal([64, 64]).astype(np.float32) * 0.2
    proj_b = rng.standard_normal([64]).astype(np.float32) * 0.1
    for param, value in ((attn.qkv.weight, qkv_w), (attn.qkv.bias, qkv_b), (attn.proj.weight, proj_w),
                         (attn.proj.bias, proj_b)):
        param.weight_loader(param, value)
    x = rng.standard_normal([3, 9, 64]).astype(np.float32)
    keep = np.ones([3, 9], bool)
    keep[1, 5:] = False
    keep[2, :] = False
    ours = attn(paddle.to_tensor(x), paddle.to_tensor(keep)).numpy()

    q, k, v = (torch.from_numpy(x) @ torch.from_numpy(qkv_w).T + torch.from_numpy(qkv_b)).split(64, dim=-1)
    q, k, v = (t.reshape(3, 9, 4, 16).transpose(1, 2) for t in (q, k, v))
    mask = torch.from_numpy(keep)[:, None, None, :]
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    ref = (sdpa.transpose(1, 2).reshape(3, 9, 64) @ torch.from_numpy(proj_w).T + torch.from_numpy(proj_b)).numpy()
    assert np.isfinite(ours).all()
    np.testing.assert_array_equal(ours[2], np.broadcast_to(proj_b, [9, 64]))
    assert rel_err(ours, ref) <= REL_TOL


def test_projector_matches_spec_formula():
    torch.manual_seed(0)
    in_dim, out_dim, k = 64, 96, 5
    w0, b0 = torch.randn(out_dim, in_dim * k) * 0.05, torch.randn(out_dim) * 0.1
    w2, b2 = torch.randn(out_dim, out_dim) * 0.1, torch.randn(out_dim) * 0.1
    projector = AudioProjectorSubsample(None, "audio_projector", in_dim, out_dim, k)
    params = dict(projector.named_parameters())
    assert {n: p.param_path for n, p in params.items()} == {
        f"net.{i}.{s}": f"audio_projector.net.{i}.{s}" for i in (0, 2) for s in ("weight", "bias")
    }
    for name, value in (("net.0.weight", w0), ("net.0.bias", b0), ("net.2.weight", w2), ("net.2.bias", b2)):
        params[name].weight_loader(params[name], value.numpy())

    x = torch.randn(2, 23, in_dim)
    keep = torch.ones(2, 23, dtype=torch.bool)
    keep[1, 11:] = False
    ours, ours_keep = projector(paddle.to_tensor(x.numpy()), paddle.to_tensor(keep.numpy()))
    # Spec: drop T mod 5 frames, concatenate 5 consecutive frames frame-major, Linear -> erf GELU -> Linear.
    stacked = x[:, :20].reshape(2, 4, 5 * in_dim)
    ref = torch.nn.functional.linear(torch.nn.functional.gelu(torch.nn.functional.linear(stacked, w0, b0)), w2, b2)
    assert ours.shape == [2, 4, out_dim]
    assert rel_err(ours.numpy(), ref.numpy()) <= REL_TOL
    np.testing.assert_array_equal(ours_keep.numpy(), [[True] * 4, [True, True, True, False]])


def test_parameter_names_and_loader_errors():
    config = DashengConfig.from_hf_config(TINY)
    encoder = DashengAudioEncoder(None, "audio_encoder", config)
    paths = {p.param_path for p in encoder.parameters()}
    assert "audio_encoder.blocks.1.attn.qkv.weight" in paths
    assert "audio_encoder.patch_embed.proj.weight" in paths
    assert "audio_encoder.init_bn._variance" in paths
    assert not any(".block1." in p or "block0" in p for p in paths)
    qkv = encoder.blocks[0].attn.qkv.weight
    with pytest.raises(WeightLoadError, match="audio_encoder.blocks.0.attn.qkv.weight"):
        qkv.weight_loader(qkv, np.zeros([192, 32], np.float32))
    pos = encoder.time_pos_embed
    with pytest.raises(WeightLoadError, match="audio_encoder.time_pos_embed"):
        pos.weight_loader(pos, np.zeros([1, 64, 1, 252], np.float32))


def test_encoder_input_errors():
    encoder = DashengAudioEncoder(None, "audio_encoder", DashengConfig.from_hf_config(TINY))
    with pytest.raises(ValueError, match=r"features must have shape \[B, 64, T\]"):
        encoder(paddle.zeros([1, 32, 100]))
    with pytest.raises(ValueError, match="a patch needs 4"):
        encoder(paddle.zeros([1, 64, 3]))
    with pytest.raises(ValueError, match=r"num_samples must have shape \[1\]"):
        encoder(paddle.zeros([1, 64, 100]), [16000, 16000])


def hf_config(**encoder_overrides):
    encoder = {**TINY, "n_mels": 64, "hop_length": 160, "init_values": None, "outputdim": 527, **encoder_overrides}
    return {"architectures": ["MiDashengLMModel"], "audio_encoder_config": encoder, "subsample_factor": 5,
            "audio_token_id": 255, "text_config": {"hidden_size": 96, "vocab_size": 256}}


def test_config_from_hf():
    config = MiDashengLMConfig.from_hf_config(hf_config())
    enc = config.audio_encoder_config
    assert (enc.head_dim, enc.mlp_hidden_dim, enc.chunk_patches, enc.samples_per_patch) == (16, 256, 16, 640)
    assert (config.projector_input_dim, config.text_hidden_size, config.audio_token_id) == (320, 96, 255)
    assert config.text_config == {"hidden_size": 96, "vocab_size": 256}
    assert config.check_audio_token_id(255) == 255
    with pytest.raises(ConfigError, match="audio_token_id 255 != tokenizer"):
        config.check_audio_token_id(254)


@pytest.mark.parametrize(
    "cfg, match",
    [
        ({**hf_config(), "architectures": ["DashengQwen25OmniModelInstruct"]}, "miaudiollm"),
        ({k: v for k, v in hf_config().items() if k != "text_config"}, "'text_config' is missing"),
        ({**hf_config(), "text_config": {"vocab_size": 256}}, "text_config: required key 'hidden_size'"),
        ({**hf_config(), "audio_token_id": 300}, "outside text_config.vocab_size"),
        (hf_config(num_heads=5), "embed_dim / num_heads: 64 is not divisible by 5"),
        (hf_config(patch_size=[32, 4], patch_stride=[32, 4]), r"patch_size \[32, 4\] must span all n_mels=64"),
        (hf_config(patch_size=[64, 4], patch_stride=[64, 2]), "!= patch_stride"),
        (hf_config(patch_size=[64, 8], patch_stride=[64, 8]), "must cover 4 frames"),
        (hf_config(n_mels=128), "'n_mels' = 128 is not supported"),
        (hf_config(hop_length=320), "'hop_length' = 320 is not supported"),
        (hf_config(init_values=0.1), "LayerScale"),
        (hf_config(depth=None), "'depth' is missing"),
        (hf_config(qkv_bias="yes"), "'qkv_bias' must be bool"),
    ],
    ids=["legacy-arch", "no-text-config", "no-text-hidden", "token-id-range", "heads", "patch-vs-mels",
         "patch-vs-stride", "patch-frames", "n-mels", "hop", "layer-scale", "missing-depth", "bool-type"],
)
def test_config_errors(cfg, match):
    with pytest.raises(ConfigError, match=match):
        MiDashengLMConfig.from_hf_config(cfg)


TP_WORKER = r"""
import json, sys
import numpy as np, paddle, paddle.distributed as dist
from fastdeploy_ext.config.base import FDConfig, ParallelConfig
from fastdeploy_ext.config.base import ConfigError
from fastdeploy_ext.config.dasheng import DashengConfig
from fastdeploy_ext.models.midashenglm.config import MiDashengLMConfig
from fastdeploy_ext.layers.audio.dasheng import DashengAudioEncoder

dist.init_parallel_env()
rank = dist.get_rank()
data = np.load(sys.argv[1])
fd_config = FDConfig(model_config=None, parallel_config=ParallelConfig(2, rank, dist.new_group([0, 1])))
encoder = DashengAudioEncoder(fd_config, "audio_encoder", DashengConfig.from_hf_config(json.loads(sys.argv[2])))
assert encoder.blocks[0].attn.qkv.weight.shape == [64, 96], "each rank holds 2 of 4 heads of q, k and v"
for name, param in encoder.named_parameters():
    param.weight_loader(param, data["w:" + name])
hidden, _ = encoder(paddle.to_tensor(data["features"]), data["num_samples"])
np.save(f"{sys.argv[3]}.{rank}.npy", hidden.numpy())
"""


def free_ports(n):
    import socket

    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def test_tensor_parallel_2_matches_tp1(dasheng_pretrained, tmp_path):
    """TP = 2 over gloo: qkv split per q/k/v section by heads, proj/fc2 row-parallel; equals TP = 1."""
    import json
    import os
    import subprocess
    import sys

    encoder, reference = build_pair(dasheng_pretrained, 21)
    lengths = [int(1.1 * SR), 3 * SR]
    padded = np.zeros([2, max(lengths)], np.float32)
    for b, n in enumerate(lengths):
        padded[b, :n] = waveform(n, b)
    features = log_mel_spectrogram(padded, lengths)
    want, _ = encoder(features, lengths)
    weights = {"w:" + checkpoint_name_to_param(k): v.numpy() for k, v in reference.state_dict().items()
               if checkpoint_name_to_param(k) is not None}
    np.savez(tmp_path / "data.npz", features=features.numpy(), num_samples=np.array(lengths), **weights)
    script = tmp_path / "worker.py"
    script.write_text(TP_WORKER)
    ports = free_ports(2)
    endpoints = ",".join(f"127.0.0.1:{p}" for p in ports)
    procs = []
    for rank in range(2):
        env = dict(os.environ, PADDLE_TRAINER_ID=str(rank), PADDLE_TRAINERS_NUM="2", PADDLE_TRAINER_ENDPOINTS=endpoints,
                   PADDLE_CURRENT_ENDPOINT=f"127.0.0.1:{ports[rank]}", PADDLE_DISTRI_BACKEND="gloo")
        procs.append(subprocess.Popen(
            [sys.executable, str(script), str(tmp_path / "data.npz"), json.dumps(TINY), str(tmp_path / "out")],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        ))
    for rank, proc in enumerate(procs):
        log, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, f"rank {rank} failed:\n{log[-3000:]}"
    for rank in range(2):
        got = np.load(tmp_path / f"out.{rank}.npy")
        assert rel_err(got, want.numpy()) <= REL_TOL
