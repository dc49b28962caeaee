"""The official `openai` client against the server running the real worker (CPU backend, the default model).

Answers are kept to a few tokens: the NumPy backend is slow on a 2-core CI machine, and what is checked here is the
service (shapes, usage, finish reasons, cancel), not the model (the engine's own tests compare it with llama.cpp).
"""
import json
import sys

import pytest

from fakes.server_kit import ROOT, running_server

openai = pytest.importorskip("openai", reason="the openai client is a test dependency: pip install -r requirements-test.txt")

pytestmark = pytest.mark.slow
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def real_server(tmp_path_factory, fixtures_dir):
    from engine.default_model import DefaultModelError, default_model_path
    try:
        model = default_model_path(fetch=True)
    except DefaultModelError as e:
        pytest.skip(f"the default model cannot be fetched, so the real-worker tests cannot run: {e}")
    from server.config import validate
    from server.text import TextCodec
    tmp = tmp_path_factory.mktemp("openai")
    cfg = validate(dict(model=str(model), worker=[sys.executable, str(ROOT / "strata_worker.py")],
                        args=["--backend", "cpu", "--ctx", "512"], port=0, log=str(tmp / "worker.log"),
                        engine_silence_s=120), tmp)
    with running_server(cfg, TextCodec.from_gguf(model)) as (httpd, base):
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=300)
        yield httpd, base, client


def test_chat_non_stream(real_server, fixtures_dir):
    _, _, client = real_server
    ref = json.loads((fixtures_dir / "reference" / "smollm2-135m-chat.json").read_text())["cases"][0]
    r = client.chat.completions.create(model="any", messages=FRANCE, max_tokens=3)
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.content.strip()
    assert r.usage.completion_tokens == 3
    # the template and the vocabulary made exactly llama.cpp's prompt
    assert r.usage.prompt_tokens == len(ref["prompt_ids"]) == r.usage.total_tokens - 3


def test_chat_stream(real_server):
    _, _, client = real_server
    stream = client.chat.completions.create(model="any", messages=FRANCE, max_tokens=3, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text.strip() and finishes == ["length"]
    assert chunks[-1].usage.completion_tokens == 3
    # the same conversation again: the worker reused its cached prefix
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0


def test_completions(real_server):
    _, _, client = real_server
    r = client.completions.create(model="any", prompt="The capital of France is", max_tokens=2)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 2 and r.choices[0].text
    parts = list(client.completions.create(model="any", prompt="The capital of France is", max_tokens=2, stream=True))
    assert "".join(p.choices[0].text for p in parts) == r.choices[0].text      # greedy: the same answer
    assert parts[-1].choices[0].finish_reason == "length"


def test_client_closing_mid_stream_leaves_the_next_request_unaffected(real_server):
    httpd, base, client = real_server
    stream = client.chat.completions.create(
        model="any", messages=[{"role": "user", "content": "Tell me a long story about a dragon."}],
        max_tokens=200, stream=True)
    got = 0
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            got += 1
            if got == 2:
                break
    stream.close()
    r = client.chat.completions.create(model="any", messages=FRANCE, max_tokens=2)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 2
    hist = httpd.service.snapshot()["history"]
    assert [h["finish"] for h in hist[-2:]] == ["cancel", "length"]
    assert 2 <= hist[-2]["generated"] < 200
    assert httpd.service.snapshot()["worker"]["starts"] == 1
