"""Time the MiDashengLM audio path: log-mel frontend, Dasheng encoder, projector (random weights, fp32).

    python benchmarks/bench_audio_encoder.py --size tiny --seconds 10 --batch 4
    python benchmarks/bench_audio_encoder.py --size 7b --seconds 10 --batch 1 --depth 4

``--size 7b`` uses the MiDashengLM-7B encoder shape (embed 1280, 16 heads, target_length 1008, projector 6400 -> 3584);
``--depth`` overrides the number of blocks so the 630 M-parameter encoder can be sampled on small machines (time
scales linearly in depth). Prints one line per stage: median wall time over ``--repeat`` runs after one warm-up.
"""

import argparse
import statistics
import time

import numpy as np
import paddle

from fastdeploy_ext.config.midashenglm import DashengConfig
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


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--depth", type=int, default=None, help="override the number of encoder blocks")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    encoder_cfg, text_hidden = SIZES[args.size]
    encoder_cfg = dict(encoder_cfg, patch_size=[64, 4], patch_stride=[64, 4], qkv_bias=True)
    if args.depth is not None:
        encoder_cfg["depth"] = args.depth
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
    print(f"device={paddle.device.get_device()} size={args.size} depth={config.depth} batch={args.batch} "
          f"seconds={args.seconds} patches={hidden.shape[1]}")
    for name, t in (("frontend", t_front), ("encoder", t_enc), ("projector", t_proj)):
        print(f"{name:10s} {t * 1e3:9.1f} ms   {audio_s / t:8.1f} s audio / s")


if __name__ == "__main__":
    main()
