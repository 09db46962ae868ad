"""Time the MiDashengLM audio path: log-mel frontend, Dasheng encoder, projector (random weights, fp32).

    python benchmarks/bench_audio_encoder.py --size tiny --seconds 10 --batch 4
    python benchmarks/bench_audio_encoder.py --size 7b --seconds 10 --batch 1 --depth 4
    python benchmarks/bench_audio_encoder.py --size 7b --depth 4 --ttft --seconds 30 --decoder-layers 2

``--size 7b`` uses the MiDashengLM-7B encoder shape (embed 1280, 16 heads, target_length 1008, projector 6400 -> 3584);
``--depth`` overrides the number of blocks so the 630 M-parameter encoder can be sampled on small machines (time
scales linearly in depth). Prints one line per stage: median wall time over ``--repeat`` runs after one warm-up,
and the encoder's clips/s.

``--ttft`` instead writes a MiDashengLM checkpoint (this encoder shape, the 7B projector and a Qwen2-7B-wide decoder
with ``--decoder-layers`` layers and a 512-token vocabulary) and times ``LLM.generate`` of one token for one clip:
audio decoding, frontend, encoder, projector, the prefill of the whole prompt and the first logits.
"""

import argparse
import os
import statistics
import tempfile
import time

import numpy as np
import paddle

from fastdeploy_ext.config.dasheng import DashengConfig
from fastdeploy_ext.layers.audio.dasheng import AudioProjectorSubsample, DashengAudioEncoder
from fastdeploy_ext.layers.audio.frontend import log_mel_spectrogram

SIZES = {
    "tiny": (dict(embed_dim=64, depth=2, num_heads=4, target_length=64), 96),
    "7b": (dict(embed_dim=1280, depth=32, num_heads=16, target_length=1008), 3584),
}


def timed(fn, repeat):
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# Qwen2.5-Omni-7B thinker text model widths; the depth is --decoder-layers (28 in the real model).
DECODER_7B = dict(hidden_size=3584, intermediate_size=18944, num_attention_heads=28, num_key_value_heads=4)


def time_to_first_token(encoder_cfg: dict, args) -> None:
    from fastdeploy_ext import LLM, SamplingParams
    from fastdeploy_ext.tiny import write_tiny

    text_cfg = dict(DECODER_7B if args.size == "7b" else {}, num_hidden_layers=args.decoder_layers)
    num_samples = int(args.seconds * 16000)
    wave = (np.random.default_rng(0).standard_normal(num_samples) * 0.1).astype(np.float32)
    prompt = ("<|im_start|>system\nYou are a helpful language and speech assistant.<|im_end|>\n<|im_start|>user\n"
              "<|audio_bos|><|AUDIO|><|audio_eos|>What is happening in this recording?<|im_end|>\n"
              "<|im_start|>assistant\n")
    request = {"prompt": prompt, "multimodal_data": {"audio": [wave]}}
    with tempfile.TemporaryDirectory() as model_dir:
        write_tiny("MiDashengLMModel", model_dir, audio_encoder_config=encoder_cfg, text_config=text_cfg)
        size_mb = os.path.getsize(os.path.join(model_dir, "model.safetensors")) / 2**20
        llm = LLM(model=model_dir, max_model_len=4096, max_num_seqs=1, max_num_batched_tokens=4096,
                  num_threads=args.threads)
        params = SamplingParams(temperature=0.0, max_tokens=1)
        out = llm.generate(request, params, use_tqdm=False)[0]
        t = timed(lambda: llm.generate(request, params, use_tqdm=False), args.repeat)
    print(f"device={paddle.device.get_device()} encoder depth={encoder_cfg['depth']} embed={encoder_cfg['embed_dim']} "
          f"decoder layers={args.decoder_layers} hidden={llm.llm_engine.model.cfg.text.hidden_size} "
          f"checkpoint={size_mb:.0f} MiB")
    print(f"time to first token, {args.seconds:g} s clip, {len(out.prompt_token_ids)} prompt tokens: {t * 1e3:.1f} ms")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--depth", type=int, default=None, help="override the number of encoder blocks")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--ttft", action="store_true", help="time to first token of a whole model (see above)")
    parser.add_argument("--decoder-layers", type=int, default=2, help="decoder depth for --ttft")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="Paddle CPU threads (Paddle's default is 1)")
    parser.add_argument("--compare-dasheng", action="store_true",
                        help="also time the PyPI dasheng encoder (torch, same shape and thread count)")
    args = parser.parse_args()
    paddle.base.core.set_num_threads(args.threads)

    encoder_cfg, text_hidden = SIZES[args.size]
    encoder_cfg = dict(encoder_cfg, patch_size=[64, 4], patch_stride=[64, 4], qkv_bias=True)
    if args.depth is not None:
        encoder_cfg["depth"] = args.depth
    if args.ttft:
        time_to_first_token(encoder_cfg, args)
        return
    config = DashengConfig.from_hf_config(encoder_cfg)
    paddle.seed(0)
    with paddle.no_grad():
        encoder = DashengAudioEncoder(None, "audio_encoder", config)
        projector = AudioProjectorSubsample(None, "audio_projector", config.embed_dim, text_hidden, 5)
        for param in list(encoder.parameters()) + list(projector.parameters()):
            param.set_value(paddle.randn(param.shape, dtype=param.dtype) * 0.02)

        num_samples = int(args.seconds * 16000)
        rng = np.random.default_rng(0)
        waves = (rng.standard_normal([args.batch, num_samples]) * 0.1).astype(np.float32)
        lengths = [num_samples] * args.batch
        features = log_mel_spectrogram(waves, lengths)
        hidden, keep = encoder(features, lengths)

        t_front = timed(lambda: log_mel_spectrogram(waves, lengths), args.repeat)
        t_enc = timed(lambda: encoder(features, lengths), args.repeat)
        t_proj = timed(lambda: projector(hidden, keep), args.repeat)

    audio_s = args.seconds * args.batch
    print(f"device={paddle.device.get_device()} threads={args.threads} size={args.size} depth={config.depth} batch={args.batch} "
          f"seconds={args.seconds} patches={hidden.shape[1]}")
    for name, t in (("frontend", t_front), ("encoder", t_enc), ("projector", t_proj)):
        print(f"{name:10s} {t * 1e3:9.1f} ms   {audio_s / t:8.1f} s audio / s")
    print(f"encoder    {args.batch / t_enc:9.2f} clips / s ({args.seconds:g} s clips, batch {args.batch})")
    if args.compare_dasheng:
        compare_dasheng(encoder_cfg, waves, args)


def compare_dasheng(encoder_cfg, waves, args):
    """The PyPI ``dasheng`` encoder (torch, random weights) on the same waveforms; its forward includes its
    own frontend, so compare with frontend + encoder above."""
    import sys

    import torch

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from tests.layers.test_dasheng_encoder import import_dasheng

    torch.set_num_threads(args.threads)
    cfg = {k: tuple(v) if isinstance(v, list) else v for k, v in encoder_cfg.items()}
    model = import_dasheng().Dasheng(**cfg).eval()
    x = torch.from_numpy(waves)
    with torch.no_grad():
        t = timed(lambda: model(x), args.repeat)
    print(f"dasheng (torch, {args.threads} threads) frontend+encoder {t * 1e3:9.1f} ms   {args.batch / t:.2f} clips / s")


if __name__ == "__main__":
    main()
