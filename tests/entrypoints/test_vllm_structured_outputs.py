"""vLLM's current ``structured_outputs`` request field and GBNF grammars (issue 29), through the official ``openai``
client's ``extra_body`` against a real server on the tiny Qwen2 (random weights at temperature 1: only the
grammar makes the outputs valid). The inputs are vLLM's own samples: its SQL grammar in GBNF
(``root ::= select_statement ...``), a regex, a choice and a JSON schema."""

import json
import re

import jsonschema
import openai
import pytest

MODEL = "tiny"
SEEDS = range(6)
MESSAGES = [{"role": "user",
             "content": "Generate an SQL query to show the 'username' and 'email' from the users table."}]
SQL_GBNF = """root ::= select_statement
select_statement ::= "SELECT " column " from " table " where " condition
column ::= "col_1 " | "col_2 "
table ::= "table_1 " | "table_2 "
condition ::= column "= " number
number ::= "1 " | "2 "
"""
SQL_RE = r"SELECT (col_1 |col_2 ) from (table_1 |table_2 ) where (col_1 |col_2 )= (1 |2 )"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def client(start_server, tiny_qwen2_dir):
    server = start_server(["--model", tiny_qwen2_dir, "--served-model-name", MODEL, "--max-model-len", "512"])
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def chat(client, extra_body, seed=0, max_tokens=64):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=1.0, seed=seed,
                                         max_tokens=max_tokens, extra_body=extra_body)
    return out.choices[0]


@pytest.mark.parametrize("seed", SEEDS)
def test_structured_outputs_json_regex_choice_grammar(client, seed):
    c = chat(client, {"structured_outputs": {"json": SCHEMA}}, seed, 256)
    assert c.finish_reason == "stop", c.message.content
    jsonschema.validate(json.loads(c.message.content), SCHEMA)
    # vLLM's sample is \w+@\w+\.com\n; bounded here, as random weights would run the \w+ to max_tokens, and
    # ASCII, as Rust's \w (llguidance) also takes combining marks that Python's re does not
    c = chat(client, {"structured_outputs": {"regex": r"[a-z0-9]{1,8}@[a-z]{1,8}\.com\n"}}, seed)
    assert re.fullmatch(r"[a-z0-9]{1,8}@[a-z]{1,8}\.com\n", c.message.content), c.message.content
    c = chat(client, {"structured_outputs": {"choice": ["Positive", "Negative"]}}, seed)
    assert c.message.content in ("Positive", "Negative")
    c = chat(client, {"structured_outputs": {"grammar": SQL_GBNF}}, seed)
    assert re.fullmatch(SQL_RE, c.message.content), c.message.content


@pytest.mark.parametrize("seed", SEEDS)
def test_gbnf_wherever_a_grammar_is_accepted(client, seed):
    c = chat(client, {"guided_grammar": SQL_GBNF}, seed)
    assert re.fullmatch(SQL_RE, c.message.content), c.message.content
    out = client.completions.create(model=MODEL, prompt="SQL:", temperature=1.0, seed=seed, max_tokens=64,
                                    extra_body={"guided_grammar": SQL_GBNF})
    assert re.fullmatch(SQL_RE, out.choices[0].text), out.choices[0].text
    out = client.completions.create(model=MODEL, prompt="SQL:", temperature=1.0, seed=seed, max_tokens=64,
                                    extra_body={"structured_outputs": {"grammar": SQL_GBNF}})
    assert re.fullmatch(SQL_RE, out.choices[0].text), out.choices[0].text


def test_structured_outputs_options(client):
    # a JSON schema given as text, as vLLM accepts it; the Lark dialect too
    c = chat(client, {"structured_outputs": {"json": json.dumps(SCHEMA), "disable_any_whitespace": True}}, 1, 256)
    jsonschema.validate(json.loads(c.message.content), SCHEMA)
    c = chat(client, {"structured_outputs": {"grammar": 'start: "ab" | "cd"'}}, 1)
    assert c.message.content in ("ab", "cd")
    # disable_additional_properties closes the open object: only "k" may appear
    open_schema = {"type": "object", "properties": {"k": {"type": "integer", "minimum": 0, "maximum": 9}},
                   "required": ["k"]}
    for seed in SEEDS:
        c = chat(client, {"structured_outputs": {"json": open_schema, "disable_additional_properties": True}},
                 seed, 256)
        assert set(json.loads(c.message.content)) == {"k"}, c.message.content
    c = chat(client, {"structured_outputs": {"json_object": True}}, 2, 128)
    if c.finish_reason == "stop":
        assert isinstance(json.loads(c.message.content), dict)


@pytest.mark.parametrize("extra_body,param", [
    ({"structured_outputs": {"json": SCHEMA}, "guided_regex": "a"}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
    ({"structured_outputs": {"regex": "a", "backend": "x"}}, "structured_outputs.backend"),
    ({"structured_outputs": {"grammar": "root ::= ((("}}, "structured_outputs.grammar"),
    ({"guided_grammar": "root ::= missing_rule"}, "guided_grammar"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex"),
])
def test_conflicts_and_bad_values_are_400_naming_the_field(client, extra_body, param):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, extra_body)
    assert e.value.body["param"] == param, e.value.body
    assert param.split(".")[-1] in e.value.body["message"] or "structured_outputs" in e.value.body["message"]
