"""Prefix caching through the real server: ``usage.prompt_tokens_details.cached_tokens``, ``cache_salt``, the
Prometheus counters and the split of in-use and cached free pages, and the periodic status line."""

import numpy as np
import openai
import pytest

from fastdeploy_ext.entrypoints.openai_server import EngineStats, stats_line

MODEL = "tiny"
BS = 4


@pytest.fixture(scope="module")
def server(start_server, tiny_qwen2_dir):
    return start_server(["--model", tiny_qwen2_dir, "--served-model-name", MODEL, "--max-model-len", "256",
                         "--block-size", str(BS), "--enable-prefix-caching"])


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_cached_tokens_salt_and_metrics(server, client):
    prompt = np.random.default_rng(8).integers(0, 500, 9 * BS + 1).tolist()

    def run(**extra):
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, **extra)
        return out.choices[0].text, out.usage.prompt_tokens_details.cached_tokens

    first, again, other_tenant, same_tenant = run(), run(), run(extra_body={"cache_salt": "b"}), \
        run(extra_body={"cache_salt": "b"})
    assert [first[1], again[1], other_tenant[1], same_tenant[1]] == [0, 9 * BS, 0, 9 * BS]
    assert first[0] == again[0] == other_tenant[0] == same_tenant[0]
    m = server.metrics()
    assert m["fastdeploy_ext_prefix_cache_query_tokens_total"] == 4 * len(prompt)
    assert m["fastdeploy_ext_prefix_cache_hit_tokens_total"] == 2 * 9 * BS
    assert m["fastdeploy_ext_kv_cache_blocks_used"] == 0 and m["fastdeploy_ext_kv_cache_blocks_cached"] >= 2 * 9


def test_n_choices_report_the_prompt_once(client):
    messages = [{"role": "system", "content": "you are a terse assistant that answers in one word " * 3},
                {"role": "user", "content": "hello"}]
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=1.0, seed=3, n=2)
    cached = out.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < out.usage.prompt_tokens and cached % BS == 0


def test_stats_line_reports_the_hit_rate_and_cached_pages():
    line = stats_line(EngineStats(running=2, waiting=1, kv_blocks_used=5, kv_blocks_cached=7, kv_blocks_total=64,
                                  tokens_per_second=12.5, prefix_cache_query_tokens_total=400,
                                  prefix_cache_hit_tokens_total=100), 3, 40.0, 12.5)
    assert line == ("running 2, waiting 1, pending 3; KV cache 7.8% (5/64 blocks in use, 7 cached free); prompt 40.0 "
                    "tokens/s, generation 12.5 tokens/s; prefix cache hit rate 25.0% (100 of 400 prompt tokens)")
    assert "hit rate n/a" in stats_line(EngineStats(), 0, 0.0, 0.0)
