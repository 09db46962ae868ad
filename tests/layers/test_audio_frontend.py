"""Dasheng log-mel frontend vs librosa (float64 oracle), and the audio loader / token count.

Oracle: ``librosa.feature.melspectrogram`` with the checkpoint's parameters (``pad_mode="reflect"`` explicit, since
librosa >= 0.10 defaults to "constant"), then ``power_to_db(top_db=120)`` per clip. The comparison covers bins within
60 dB of the clip maximum: further down, fp32 FFT round-off (relative to the frame energy) dominates the bin and
the dB value says nothing about the implementation.
"""

import io

import librosa
import numpy as np
import paddle
import pytest
import soundfile

from fastdeploy_ext.layers.audio.frontend import log_mel_spectrogram, num_frames
from fastdeploy_ext.layers.audio.io import audio_token_count, load_audio, pad_to_min_samples

SR = 16000
# 1e-3 dB is a power ratio of 2.3e-4; fp32 STFT + mel lands near 1e-4 dB on loud bins.
DB_TOL = 1e-3
DB_RANGE = 60.0


def librosa_log_mel(x: np.ndarray) -> np.ndarray:
    mel = librosa.feature.melspectrogram(
        y=x.astype(np.float64), sr=SR, n_fft=512, hop_length=160, win_length=512, window="hann", center=True,
        pad_mode="reflect", power=2.0, n_mels=64, fmin=0.0, fmax=8000.0, htk=True, norm=None, dtype=np.float64,
    )
    return librosa.power_to_db(mel, ref=1.0, amin=1e-10, top_db=120.0)


def max_db_error(ours: np.ndarray, ref: np.ndarray) -> float:
    near_top = ref >= ref.max() - DB_RANGE
    return float(np.abs(ours.astype(np.float64) - ref)[near_top].max())


def white_noise(seconds, seed=0, amplitude=0.3):
    return (np.random.default_rng(seed).standard_normal(int(seconds * SR)) * amplitude).astype(np.float32)


def chirp(seconds, f0=50.0, f1=7900.0):
    t = np.arange(int(seconds * SR)) / SR
    phase = 2 * np.pi * (f0 * t + (f1 - f0) * t**2 / (2 * seconds))
    return (0.8 * np.sin(phase)).astype(np.float32)


SIGNALS = {
    "noise_3s": lambda: white_noise(3.0),
    "chirp_4s": lambda: chirp(4.0),
    "silence_1s": lambda: np.zeros(SR, np.float32),
    "noise_0.3s": lambda: white_noise(0.3, seed=1),
    "chirp_10s": lambda: chirp(10.0),
    "noise_25s": lambda: white_noise(25.0, seed=2, amplitude=0.05),
}


@pytest.mark.parametrize("name", list(SIGNALS), ids=list(SIGNALS))
def test_log_mel_matches_librosa(name):
    x = SIGNALS[name]()
    ours = log_mel_spectrogram(x[None]).numpy()[0]
    ref = librosa_log_mel(x)
    assert ours.shape == ref.shape == (64, num_frames(x.shape[0]))
    assert ours.dtype == np.float32
    assert max_db_error(ours, ref) <= DB_TOL


def test_silence_is_floor():
    out = log_mel_spectrogram(np.zeros([1, 4000], np.float32)).numpy()
    np.testing.assert_array_equal(out, np.full_like(out, -100.0))


def test_top_db_is_per_clip():
    rng = np.random.default_rng(3)
    loud = (rng.standard_normal(SR) * 0.5).astype(np.float32)
    loud[SR // 2 :] = 0.0  # digital silence: its bins sit at the clip's own floor, max - 120 dB
    quiet = (rng.standard_normal(SR) * 1e-4).astype(np.float32)
    quiet[SR // 2 :] = 0.0  # its floor is amin's -100 dB, below the loud clip's max - 120
    batch = log_mel_spectrogram(np.stack([loud, quiet])).numpy()
    for i, clip in enumerate((loud, quiet)):
        alone = log_mel_spectrogram(clip[None]).numpy()[0]
        np.testing.assert_array_equal(batch[i], alone)
        assert max_db_error(batch[i], librosa_log_mel(clip)) <= DB_TOL
    loud_floor = batch[0].max() - 120.0
    assert batch[0].min() == pytest.approx(loud_floor, abs=1e-4)
    assert batch[1].min() == -100.0
    # A batch-global cutoff would lift these quiet-clip bins to the loud clip's floor.
    assert loud_floor > -95.0 and (batch[1] < loud_floor - 1.0).any()


def test_batched_clip_uses_its_own_reflect_padding():
    short, long = white_noise(0.7, seed=4), chirp(2.0)
    padded = np.zeros([2, long.shape[0]], np.float32)
    padded[0, : short.shape[0]] = short
    padded[1] = long
    lengths = [short.shape[0], long.shape[0]]
    batch = log_mel_spectrogram(paddle.to_tensor(padded), lengths).numpy()
    frames_short = num_frames(short.shape[0])
    assert batch.shape == (2, 64, num_frames(long.shape[0]))
    alone = log_mel_spectrogram(short[None]).numpy()[0]
    np.testing.assert_allclose(batch[0, :, :frames_short], alone, rtol=0, atol=1e-5)
    np.testing.assert_allclose(batch[1], log_mel_spectrogram(long[None]).numpy()[0], rtol=0, atol=1e-5)
    # Frames past the clip hold its floor, what zero-padded samples would give.
    floor = max(-100.0, alone.max() - 120.0)
    np.testing.assert_allclose(batch[0, :, frames_short:], floor, rtol=0, atol=1e-4)
    # Without lengths the short clip's last frames see the zero padding instead of its reflection.
    naive = log_mel_spectrogram(paddle.to_tensor(padded)).numpy()
    assert np.abs(naive[0, :, frames_short - 2 : frames_short] - alone[:, -2:]).max() > 1.0


def test_accepts_paddle_and_numpy_identically():
    x = white_noise(0.5, seed=5)[None]
    np.testing.assert_array_equal(log_mel_spectrogram(x).numpy(), log_mel_spectrogram(paddle.to_tensor(x)).numpy())


@pytest.mark.parametrize(
    "waveforms, lengths, error, match",
    [
        (np.zeros([1, 0], np.float32), None, ValueError, "empty"),
        (np.zeros([2, 1000], np.float32), [1000, 0], ValueError, "clip 1 is empty"),
        (np.array([[0.0, np.nan] * 500], np.float32), None, ValueError, "NaN or inf"),
        (np.array([[0.0, np.inf] * 500], np.float32), None, ValueError, "NaN or inf"),
        (np.zeros([1, 1000], np.float64), None, TypeError, "float32"),
        (np.zeros([1, 1000], np.int16), None, TypeError, "float32"),
        (np.zeros([1000], np.float32), None, ValueError, "rank 1"),
        (np.zeros([1, 1, 1000], np.float32), None, ValueError, "rank 3"),
        (np.zeros([2, 1000], np.float32), [1000], ValueError, r"lengths must have shape \[2\]"),
        (np.zeros([2, 1000], np.float32), [1000, 1001], ValueError, "exceeds"),
        (np.zeros([1, 1000], np.float32), [500.0], TypeError, "integers"),
        (np.zeros([1, 256], np.float32), None, ValueError, "reflect padding"),
        ([[0.0] * 1000], None, TypeError, "paddle.Tensor or numpy"),
    ],
    ids=["no-samples", "zero-length", "nan", "inf", "float64", "int16", "rank1", "rank3", "lengths-shape",
         "length-too-long", "float-lengths", "too-short", "list"],
)
def test_errors(waveforms, lengths, error, match):
    with pytest.raises(error, match=match):
        log_mel_spectrogram(waveforms, lengths)


def sine(freq, sr, seconds=1.0):
    t = np.arange(int(seconds * sr)) / sr
    return 0.5 * np.sin(2 * np.pi * freq * t)


def test_load_int16_scaling():
    pcm = np.array([0, 16384, -16384, 32767, -32768], np.int16)
    np.testing.assert_array_equal(load_audio(pcm), pcm.astype(np.float32) / 32768.0)


def test_load_wav_path_and_bytes(tmp_path):
    pcm = (sine(440, SR) * 32767).astype(np.int16)
    path = tmp_path / "a.wav"
    soundfile.write(path, pcm, SR, subtype="PCM_16")
    from_path = load_audio(str(path))
    assert from_path.dtype == np.float32
    np.testing.assert_array_equal(from_path, pcm.astype(np.float32) / 32768.0)
    np.testing.assert_array_equal(load_audio(path.read_bytes()), from_path)


def test_load_stereo_downmix_both_layouts(tmp_path):
    left, right = sine(440, SR).astype(np.float32), sine(1000, SR).astype(np.float32) * 0.3
    want = (left + right) / 2
    np.testing.assert_allclose(load_audio(np.stack([left, right], axis=1)), want, rtol=0, atol=1e-7)
    np.testing.assert_allclose(load_audio(np.stack([left, right], axis=0)), want, rtol=0, atol=1e-7)
    buf = io.BytesIO()
    soundfile.write(buf, np.stack([left, right], axis=1), SR, format="WAV", subtype="FLOAT")
    np.testing.assert_allclose(load_audio(buf.getvalue()), want, rtol=0, atol=1e-7)


@pytest.mark.parametrize("sr", [8000, 44100], ids=["8k", "44.1k"])
def test_load_resamples_to_16k(sr):
    freq = 440.0
    out = load_audio((sine(freq, sr, 2.0).astype(np.float32), sr))
    assert out.dtype == np.float32 and out.shape == (2 * SR,)
    # The resampled tone is the same tone sampled at 16 kHz (edges excluded: the filter's start-up transient).
    expected = sine(freq, SR, 2.0)
    np.testing.assert_allclose(out[SR // 4 : -SR // 4], expected[SR // 4 : -SR // 4], rtol=0, atol=2e-3)
    spectrum = np.abs(np.fft.rfft(out * np.hanning(out.shape[0])))
    assert np.fft.rfftfreq(out.shape[0], 1 / SR)[spectrum.argmax()] == pytest.approx(freq, abs=0.5)
    np.testing.assert_allclose(out, librosa.resample(sine(freq, sr, 2.0), orig_sr=sr, target_sr=SR, res_type="soxr_hq"),
                               rtol=0, atol=1e-5)


def test_load_errors(tmp_path):
    corrupt = tmp_path / "corrupt.wav"
    corrupt.write_bytes(b"RIFF\x00\x00\x00\x00WAVEjunk" * 8)
    with pytest.raises(ValueError, match="cannot decode audio file .*corrupt.wav"):
        load_audio(str(corrupt))
    with pytest.raises(FileNotFoundError, match="missing.wav"):
        load_audio(str(tmp_path / "missing.wav"))
    with pytest.raises(ValueError, match="NaN or inf"):
        load_audio(np.array([0.0, np.nan, 0.1], np.float32))
    with pytest.raises(ValueError, match="empty"):
        load_audio(np.zeros(0, np.float32))
    with pytest.raises(ValueError, match="empty"):
        load_audio(b"")
    with pytest.raises(TypeError, match="unsupported sample dtype uint8"):
        load_audio(np.zeros(100, np.uint8))
    with pytest.raises(ValueError, match="channel axis"):
        load_audio(np.zeros([100, 100], np.float32))
    with pytest.raises(ValueError, match="positive int"):
        load_audio((np.zeros(100, np.float32), 0))
    with pytest.raises(TypeError, match="unsupported audio source"):
        load_audio([0.0, 0.1])


@pytest.mark.parametrize(
    "seconds, tokens", [(0.2, 1), (1.0, 5), (10.0, 50), (10.08, 50), (30.0, 150), (0.01, 1)],
    ids=["0.2s", "1s", "10s", "10.08s", "30s", "0.01s-clamped"],
)
def test_audio_token_count(seconds, tokens):
    assert audio_token_count(round(seconds * SR)) == tokens


def test_token_count_matches_padded_frames():
    # The clamp is what the encoder sees once the processor pads a short clip to 3200 samples.
    short = pad_to_min_samples(np.ones(1000, np.float32))
    assert short.shape == (3200,) and short[1000:].max() == 0.0
    assert audio_token_count(1000) == num_frames(short.shape[0]) // 4 // 5 == 1
