import os

import pytest

os.environ.setdefault("GLOG_minloglevel", "2")


def pytest_configure(config):
    # Before any test imports transformers (which imports torchaudio when installed).
    from tests.torchaudio_fix import fix_torchaudio

    fix_torchaudio()


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory):
    from fastdeploy_ext.tiny import write_tiny

    d = str(tmp_path_factory.mktemp("tiny_qwen2"))
    write_tiny("Qwen2ForCausalLM", d, seed=0)
    return d


@pytest.fixture
def host_threads_set():
    """``set(n)`` for the host thread pool; the count the test found is restored afterwards."""
    from fastdeploy_ext.ops import host_threads

    before = host_threads.host_threads()
    yield host_threads.set_host_threads
    host_threads.set_host_threads(before)
