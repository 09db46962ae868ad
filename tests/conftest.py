import os

import pytest

os.environ.setdefault("GLOG_minloglevel", "2")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory):
    from fastdeploy_ext.tiny import write_tiny

    d = str(tmp_path_factory.mktemp("tiny_qwen2"))
    write_tiny("Qwen2ForCausalLM", d, seed=0)
    return d
