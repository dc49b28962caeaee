"""Structured output with the default model through the official openai client (issue 18's "done when"): JSON that
validates against a json_schema (10 of 10), a tool call when tool_choice names a function, and logprobs whose top
entry is the sampled token at temperature 0. The CPU backend; llguidance masks every pick."""
import json
import sys

import pytest

from fakes.server_kit import ROOT, running_server

openai = pytest.importorskip("openai", reason="the openai client is a test dependency: pip install -r requirements-test.txt")
pytest.importorskip("llguidance", reason="structured output needs llguidance: pip install -r requirements.txt")

pytestmark = pytest.mark.slow
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0,
                                                                             "maximum": 120},
                         "city": {"type": "string", "maxLength": 24}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city",
                                           "parameters": {"type": "object", "additionalProperties": False,
                                                          "required": ["city"],
                                                          "properties": {"city": {"type": "string",
                                                                                  "maxLength": 30}}}}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a time zone",
                                           "parameters": {"type": "object", "additionalProperties": False,
                                                          "required": ["zone"],
                                                          "properties": {"zone": {"type": "string",
                                                                                  "maxLength": 30}}}}}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    from engine.default_model import DefaultModelError, default_model_path
    try:
        model = default_model_path(fetch=True)
    except DefaultModelError as e:
        pytest.skip(f"the default model cannot be fetched: {e}")
    from server.config import validate
    from server.text import TextCodec
    tmp = tmp_path_factory.mktemp("structured")
    cfg = validate(dict(model=str(model), worker=[sys.executable, str(ROOT / "strata_worker.py")],
                        args=["--backend", "cpu", "--ctx", "1024"], port=0, log=str(tmp / "worker.log"),
                        engine_silence_s=120), tmp)
    with running_server(cfg, TextCodec.from_gguf(model)) as (_, base):
        yield openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=600)


def valid_person(obj) -> bool:
    return (isinstance(obj, dict) and set(obj) == {"name", "age", "city"} and isinstance(obj["name"], str)
            and len(obj["name"]) <= 24 and isinstance(obj["age"], int) and not isinstance(obj["age"], bool)
            and 0 <= obj["age"] <= 120 and isinstance(obj["city"], str) and len(obj["city"]) <= 24)


def test_ten_json_schema_answers_parse_and_validate(client):
    ok = 0
    for i in range(10):
        r = client.chat.completions.create(
            model="any", max_tokens=80, temperature=0.8, seed=i,
            messages=[{"role": "user", "content": "Invent a person: their name, age and city."}],
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
        assert r.choices[0].finish_reason == "stop", r.choices[0]
        obj = json.loads(r.choices[0].message.content)
        ok += valid_person(obj)
    assert ok == 10


def test_json_object(client):
    r = client.chat.completions.create(model="any", max_tokens=200, temperature=0, messages=[
        {"role": "user", "content": "Reply with a JSON object with two keys: the name and the color of a cat."}],
        response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_a_named_tool_choice_gives_that_call(client):
    r = client.chat.completions.create(
        model="any", max_tokens=60, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
        messages=[{"role": "user", "content": "What is the weather like in Paris?"}])
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
    call = c.message.tool_calls[0]
    assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str)
    r = client.chat.completions.create(model="any", max_tokens=60, tools=TOOLS, tool_choice="required",
                                       messages=[{"role": "user", "content": "What time is it in Tokyo?"}])
    assert r.choices[0].message.tool_calls[0].function.name in ("get_weather", "get_time")


def test_logprobs_top_entry_is_the_sampled_token_at_temperature_0(client):
    r = client.chat.completions.create(model="any", max_tokens=8, temperature=0, logprobs=True, top_logprobs=3,
                                       messages=[{"role": "user", "content": "What is the capital of France?"}])
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens > 0
    assert "".join(e.token for e in content) == r.choices[0].message.content
    for e in content:
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == pytest.approx(e.logprob)
        assert e.logprob <= 0 and [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs),
                                                                                reverse=True)
    r = client.completions.create(model="any", prompt="The capital of France is", max_tokens=4, temperature=0,
                                  logprobs=2)
    lp = r.choices[0].logprobs
    assert all(max(top, key=top.get) == t for t, top in zip(lp.tokens, lp.top_logprobs))
