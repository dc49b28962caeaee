"""Forced tool calls and strict json_schema follow their schemas with additionalProperties: false semantics (issue
33), as OpenAI's strict mode and llama.cpp's tool grammars do: no property the schema does not list, in any object
that does not say otherwise.

closed_schema on its own; the grammars it feeds, checked by llguidance over the tiny vocabulary (a text is accepted
when its tokens are); and the default model (SmolLM2, CPU backend) answering 10 forced calls and 10 strict requests
whose schemas leave additionalProperties unsaid, every answer checked against the closed schema."""
import copy
import json
import sys

import pytest

from server.grammar import GrammarRequestError, closed_schema, response_format_grammar, tool_call_grammar

llguidance = pytest.importorskip("llguidance", reason="structured output needs llguidance: pip install -r requirements.txt")

WEATHER = {"type": "object", "required": ["city"],
           "properties": {"city": {"type": "string", "maxLength": 40},
                          "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}
TIME = {"type": "object", "required": ["zone"], "properties": {"zone": {"type": "string", "maxLength": 40}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a time zone",
                                           "parameters": TIME}}]
# A schema that says nothing of other properties, at the top and in a nested object and array items.
TRIP = {"type": "object", "required": ["city", "days", "hotel"],
        "properties": {"city": {"type": "string", "maxLength": 30},
                       "days": {"type": "integer", "minimum": 1, "maximum": 30},
                       "hotel": {"type": "object", "required": ["name"],
                                 "properties": {"name": {"type": "string", "maxLength": 30},
                                                "stars": {"type": "integer", "minimum": 1, "maximum": 5}}},
                       "sights": {"type": "array", "maxItems": 3,
                                  "items": {"type": "object", "required": ["name"],
                                            "properties": {"name": {"type": "string", "maxLength": 30}}}}}}


# --- closed_schema ---------------------------------------------------------------------------------------------------
def test_every_object_that_lists_properties_is_closed_and_the_input_is_left_alone():
    before = copy.deepcopy(TRIP)
    c = closed_schema(TRIP)
    assert TRIP == before
    assert c["additionalProperties"] is False and c["properties"]["hotel"]["additionalProperties"] is False
    assert c["properties"]["sights"]["items"]["additionalProperties"] is False
    assert "additionalProperties" not in c["properties"]["city"]          # not an object


def test_what_a_schema_says_of_other_properties_is_kept():
    open_ = {"type": "object", "properties": {"a": {}}, "additionalProperties": True}
    typed = {"type": "object", "properties": {"a": {}}, "additionalProperties": {"type": "object",
                                                                                 "properties": {"x": {}}}}
    pattern = {"type": "object", "properties": {"a": {}}, "patternProperties": {"^x_": {"type": "integer"}}}
    assert closed_schema(open_) == open_ and closed_schema(pattern) == pattern
    assert closed_schema(typed)["additionalProperties"] == {"type": "object", "properties": {"x": {}},
                                                            "additionalProperties": False}
    free = {"type": "object", "properties": {"meta": {"type": "object"}}}
    assert closed_schema(free)["properties"]["meta"] == {"type": "object"}    # lists nothing: free-form


def test_data_is_not_taken_for_schemas():
    s = {"type": "object", "properties": {"p": {"type": "object", "default": {"properties": {}}, "enum": [
        {"properties": 1}], "const": {"properties": {}}, "examples": [{"properties": {}}]}}}
    p = closed_schema(s)["properties"]["p"]
    assert p["default"] == {"properties": {}} and p["enum"] == [{"properties": 1}]
    assert p["const"] == {"properties": {}} and p["examples"] == [{"properties": {}}]


def test_unions_refs_and_all_of():
    s = {"$defs": {"Addr": {"type": "object", "properties": {"street": {"type": "string"}}},
                   "Base": {"type": "object", "properties": {"id": {"type": "integer"}}}},
         "anyOf": [{"type": "object", "properties": {"a": {}}}, {"$ref": "#/$defs/Addr"}],
         "properties": {"both": {"allOf": [{"$ref": "#/$defs/Base"},
                                           {"type": "object", "properties": {"name": {"type": "string"}}}]}}}
    c = closed_schema(s)
    assert c["anyOf"][0]["additionalProperties"] is False and c["$defs"]["Addr"]["additionalProperties"] is False
    both = c["properties"]["both"]
    # the branches stay open (each would refuse the other's properties); the parent is closed over both
    assert "additionalProperties" not in both["allOf"][1] and "additionalProperties" not in c["$defs"]["Base"]
    assert both["additionalProperties"] is False and set(both["properties"]) == {"id", "name"}


# --- the grammars ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def accepts(fixtures_dir):
    from engine.grammar import Vocabulary
    from engine.tokenizer import Tokenizer
    tok = Tokenizer.from_gguf(fixtures_dir / "vocab" / "tiny-bpe-1024.gguf")
    vocab = Vocabulary(tok, [tok.eos_id])

    def check(grammar: str, text: str) -> bool:
        m = llguidance.LLMatcher(vocab.lltok, grammar, log_level=0)
        assert not m.is_error(), m.get_error()
        return all(m.consume_token(t) for t in tok.encode(text, add_special=False)) and m.is_accepting()
    return check


def call(name, args) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args}, separators=(",", ":"))}\n</tool_call>'


def test_a_forced_call_takes_no_property_its_function_does_not_list(accepts):
    named = tool_call_grammar(TOOLS, {"type": "function", "function": {"name": "get_weather"}})
    assert accepts(named, call("get_weather", {"city": "Paris"}))
    assert accepts(named, call("get_weather", {"city": "Paris", "unit": "celsius"}))
    # what SmolLM2 wrote before (issue 33): a property of the schema's own words, and one it made up
    assert not accepts(named, call("get_weather", {"city": "Paris", "type": "string"}))
    assert not accepts(named, call("get_weather", {"city": "Paris", "temperature": "28"}))
    assert not accepts(named, call("get_time", {"zone": "UTC"}))
    required = tool_call_grammar(TOOLS, "required")
    assert accepts(required, call("get_time", {"zone": "UTC"}))
    assert not accepts(required, call("get_time", {"zone": "UTC", "city": "Paris"}))


def test_a_function_without_parameters_is_called_with_none(accepts):
    g = tool_call_grammar([{"type": "function", "function": {"name": "now"}}], "required")
    assert accepts(g, call("now", {})) and not accepts(g, call("now", {"zone": "UTC"}))
    with pytest.raises(GrammarRequestError, match="not a JSON schema object"):
        tool_call_grammar([{"type": "function", "function": {"name": "now", "parameters": "none"}}], "required")


def test_strict_json_schema_is_closed_and_a_plain_one_is_not(accepts):
    answer = {"city": "Rome", "days": 3, "hotel": {"name": "Roma"}}
    extra_top = {**answer, "price": 100}
    extra_nested = {**answer, "hotel": {"name": "Roma", "pool": True}}
    extra_item = {**answer, "sights": [{"name": "Colosseum", "open": True}]}

    def fmt(strict):
        return response_format_grammar({"type": "json_schema", "json_schema": {"name": "trip", "schema": TRIP,
                                                                               "strict": strict}})
    strict, plain = fmt(True), fmt(False)
    for text in (answer, {**answer, "sights": [{"name": "Colosseum"}]}):
        assert accepts(strict, json.dumps(text, separators=(",", ":")))
    for text in (extra_top, extra_nested, extra_item):
        assert not accepts(strict, json.dumps(text, separators=(",", ":"))), text
        assert accepts(plain, json.dumps(text, separators=(",", ":"))), text     # JSON Schema's own default
    with pytest.raises(GrammarRequestError, match="strict"):
        response_format_grammar({"type": "json_schema", "json_schema": {"schema": TRIP, "strict": "yes"}})


# --- the default model -----------------------------------------------------------------------------------------------
def valid(value, schema) -> bool:
    """value against the closed reading of the subset of JSON Schema these tests use."""
    t = schema.get("type")
    if "enum" in schema and value not in schema["enum"]:
        return False
    if t == "string":
        return isinstance(value, str) and len(value) <= schema.get("maxLength", len(value))
    if t == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)
                and schema.get("minimum", value) <= value <= schema.get("maximum", value))
    if t == "array":
        return (isinstance(value, list) and len(value) <= schema.get("maxItems", len(value))
                and all(valid(v, schema["items"]) for v in value))
    if t == "object":
        props = schema.get("properties", {})
        return (isinstance(value, dict) and set(value) <= set(props) and set(schema.get("required", [])) <= set(value)
                and all(valid(v, props[k]) for k, v in value.items()))
    return t is None


def test_the_checker_refuses_extra_properties():
    assert valid({"city": "Paris"}, WEATHER) and not valid({"city": "Paris", "type": "string"}, WEATHER)
    assert not valid({"city": "Rome", "days": 3, "hotel": {"name": "R", "pool": 1}}, TRIP)


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    openai = pytest.importorskip("openai", reason="the openai client is a test dependency: "
                                                  "pip install -r requirements-test.txt")
    from engine.default_model import DefaultModelError, default_model_path
    from fakes.server_kit import ROOT, running_server
    from server.config import validate
    from server.text import TextCodec
    try:
        model = default_model_path(fetch=True)
    except DefaultModelError as e:
        pytest.skip(f"the default model cannot be fetched: {e}")
    tmp = tmp_path_factory.mktemp("strict")
    cfg = validate(dict(model=str(model), worker=[sys.executable, str(ROOT / "strata_worker.py")],
                        args=["--backend", "cpu", "--ctx", "1024"], port=0, log=str(tmp / "worker.log"),
                        engine_silence_s=120), tmp)
    with running_server(cfg, TextCodec.from_gguf(model)) as (_, base):
        yield openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=600)


QUESTIONS = ["What is the weather like in Paris?", "Is it raining in Tokyo right now?",
             "How warm is it in Cairo, in fahrenheit?", "What time is it in New York?", "Weather in Oslo today?"]


@pytest.mark.slow
def test_ten_forced_calls_follow_their_schemas(client):
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    ok, seen = 0, []
    for i in range(10):
        choice = {"type": "function", "function": {"name": "get_weather"}} if i % 2 == 0 else "required"
        r = client.chat.completions.create(model="any", max_tokens=120, temperature=0.8, seed=i, tools=TOOLS,
                                           tool_choice=choice,
                                           messages=[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}])
        c = r.choices[0]
        calls = c.message.tool_calls or []
        seen.append((c.finish_reason, [(k.function.name, k.function.arguments) for k in calls], c.message.content))
        if c.finish_reason != "tool_calls" or len(calls) != 1:
            continue
        name = calls[0].function.name
        if i % 2 == 0 and name != "get_weather":
            continue
        ok += name in params and valid(json.loads(calls[0].function.arguments), params[name])
    assert ok == 10, seen


@pytest.mark.slow
def test_ten_strict_json_schema_answers_follow_the_schema(client):
    ok, seen = 0, []
    for i in range(10):
        r = client.chat.completions.create(
            model="any", max_tokens=120, temperature=0.8, seed=i,
            messages=[{"role": "user", "content": "Plan a short trip: a city, the number of days and a hotel."}],
            response_format={"type": "json_schema", "json_schema": {"name": "trip", "schema": TRIP, "strict": True}})
        c = r.choices[0]
        seen.append((c.finish_reason, c.message.content))
        if c.finish_reason == "stop":
            ok += valid(json.loads(c.message.content), TRIP)
    assert ok == 10, seen
