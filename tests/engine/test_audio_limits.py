"""Audio is bounded by its header before anything is decoded (issue 16): lying headers, out-of-range rates,
long clips and out-of-range float samples are refused, and a decode reads at most the header's frames."""

import io
import struct

import numpy as np
import pytest
import soundfile

from fastdeploy_ext.layers.audio.io import load_audio, read_audio_header


def encode(samples, rate, fmt="WAV", subtype=None) -> bytes:
    buf = io.BytesIO()
    soundfile.write(buf, samples, rate, format=fmt, subtype=subtype)
    return buf.getvalue()


class Counter:
    def __init__(self):
        self.frames = 0

    def __call__(self, n):
        self.frames += n


def flac_claiming(frames_claimed: int) -> bytes:
    """A 1 s FLAC whose STREAMINFO says ``frames_claimed`` samples (36-bit field)."""
    b = bytearray(encode(np.zeros(16000, np.float32), 16000, "FLAC"))
    field = int.from_bytes(b[18:26], "big")
    field = (field & ~((1 << 36) - 1)) | frames_claimed
    b[18:26] = field.to_bytes(8, "big")
    return bytes(b)


def wav_with_rate(rate: int) -> bytes:
    b = bytearray(encode(np.zeros(13600 // 2, np.int16), 8000, subtype="PCM_16"))
    b[24:28], b[28:32] = struct.pack("<I", rate), struct.pack("<I", 2 * rate)
    return bytes(b)


def test_flac_header_claiming_68_billion_frames_is_refused_before_decoding():
    data = flac_claiming((1 << 36) - 1)
    assert read_audio_header(data, "x").frames == (1 << 36) - 1
    seen = Counter()
    with pytest.raises(ValueError, match=r"4294967\.3 s long by its header .* limit is 300 s"):
        load_audio(data, on_frames=seen)
    assert seen.frames == 0


def test_one_hertz_wav_is_refused_before_resampling():
    """The issue's 13.6 kB WAV at 1 Hz became 640 MB of 16 kHz samples."""
    seen = Counter()
    with pytest.raises(ValueError, match=r"sampled at 1 Hz; supported rates are 8000-192000 Hz"):
        load_audio(wav_with_rate(1), on_frames=seen)
    assert seen.frames == 0
    with pytest.raises(ValueError, match=r"sampled at 4000 Hz"):
        load_audio((np.zeros(4000, np.float32), 4000))
    with pytest.raises(ValueError, match=r"sampled at 384000 Hz"):
        load_audio(wav_with_rate(384000))


def test_clip_over_max_seconds_is_refused_by_its_header():
    data = encode(np.zeros(32000, np.float32), 16000)
    seen = Counter()
    with pytest.raises(ValueError, match=r"2\.0 s long by its header .* limit is 1\.5 s"):
        load_audio(data, max_seconds=1.5, on_frames=seen)
    assert seen.frames == 0
    with pytest.raises(ValueError, match=r"2\.0 s long; the limit is 1\.5 s"):
        load_audio((np.zeros(32000, np.float32), 16000), max_seconds=1.5)


def test_decode_reads_exactly_the_admitted_frames_in_blocks():
    rng = np.random.default_rng(0)
    stereo = (0.2 * rng.standard_normal([200_000, 2])).astype(np.float32)
    seen = Counter()
    out = load_audio(encode(stereo, 44100, subtype="FLOAT"), on_frames=seen)
    assert seen.frames == 200_000
    # Block-wise decode + streamed resampling equals the one-shot pipeline.
    import soxr

    want = soxr.resample(stereo.mean(axis=1, dtype=np.float32), 44100, 16000, quality="HQ")
    np.testing.assert_array_equal(out, want.astype(np.float32))


@pytest.mark.parametrize("value", [3e38, 32768.5, -40000.0], ids=["3e38", "just_past_2^15", "-40000"])
def test_float_samples_past_int16_full_scale_are_refused(value):
    samples = np.zeros(16000, np.float32)
    samples[100] = value
    with pytest.raises(ValueError, match=r"audio bytes .* above 2\^15 = 32768"):
        load_audio(encode(samples, 16000, subtype="FLOAT"))
    with pytest.raises(ValueError, match=r"audio array has float samples up to .* above 2\^15.*divide it by 32768"):
        load_audio(samples)
    with pytest.raises(ValueError, match=r"above 2\^15"):
        load_audio(np.stack([np.zeros(16000, np.float32), samples], axis=1))  # one channel past it, not the mean


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
def test_non_finite_samples_are_refused(value):
    samples = np.zeros(16000, np.float64)
    samples[7] = value
    with pytest.raises(ValueError, match="NaN or inf samples"):
        load_audio(samples)
    with pytest.raises(ValueError, match="NaN or inf samples"):
        load_audio(encode(samples.astype(np.float32), 16000, subtype="FLOAT"))


def test_float64_too_large_for_float32_is_named_by_its_peak_not_as_inf():
    samples = np.zeros(16000, np.float64)
    samples[3] = 1e300
    with pytest.raises(ValueError, match=r"up to \|x\| = 1e\+300, above 2\^15"):
        load_audio(samples)


@pytest.mark.parametrize("peak", [1.0, 1.13, 1.5, -1.0001, 32768.0])
def test_finite_float_samples_are_taken_as_they_are(peak):
    """Overshoots past 1.0 (Gaussian noise, resampled or gain-adjusted recordings) are kept unchanged, up to and
    including int16 full scale, as HF's feature extractor and vLLM take them."""
    samples = np.random.default_rng(32).standard_normal(16000).astype(np.float32) * np.float32(0.3)
    samples[100] = peak
    np.testing.assert_array_equal(load_audio(samples), samples)
    np.testing.assert_array_equal(load_audio(samples.astype(np.float64)), samples)
    np.testing.assert_array_equal(load_audio(encode(samples, 16000, subtype="FLOAT")), samples)
