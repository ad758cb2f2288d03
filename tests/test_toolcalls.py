"""Tool-call formats (`infer.serve.toolcalls`), everyday and fast: each format's parse of recorded
answers (text around calls, several calls, values typed by the tool's schema), its stream fed in
random chunks reassembling to the whole parse, malformed calls coming back as content, the call
patterns matching the text a call is, and `format_for`'s choice by template and model_type."""

from __future__ import annotations

import json
import random
import re

import pytest

from infer.serve.toolcalls import FORMATS, assemble, format_for

TOOLS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                          "metric": {"type": "boolean"}},
                         "required": ["city"]},
         "search": {"type": "object", "properties": {"query": {"type": "string"}, "filters": {"type": "object"}}}}

PARIS = ("get_weather", {"city": "Paris", "days": 3})
ROME = ("get_weather", {"city": "Rome"})
SEARCH = ("search", {"query": "a < b; c", "filters": {"k": [1, 2]}})

# (format, answer, content, calls): answers as the models write them (their special tokens kept).
RECORDED = [
    ("hermes", 'Let me check.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
               '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}\n</tool_call>',
     "Let me check.", [PARIS, ROME]),
    ("hermes", "<think>\nweather</think>\n\n<tool_call>\n{\"name\": \"search\", \"arguments\": {\"query\": \"a < b; c\", "
               "\"filters\": {\"k\": [1, 2]}}}\n</tool_call>", "<think>\nweather</think>", [SEARCH]),
    ("hermes", "No tools needed: 2 + 2 = 4.\n", "No tools needed: 2 + 2 = 4.\n", []),
    ("qwen3_coder", "Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>"
                    "\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>"
                    "\nRome\n</parameter>\n</function>\n</tool_call>", "Sure.", [PARIS, ROME]),
    ("qwen3_coder", "<tool_call>\n<function=search>\n<parameter=query>\na < b; c\n</parameter>\n<parameter=filters>\n"
                    '{"k": [1, 2]}\n</parameter>\n</function>\n</tool_call>', None, [SEARCH]),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}', None, [PARIS]),
    ("llama3", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}; '
               '{"name": "search", "arguments": {"query": "a < b; c", "filters": {"k": [1, 2]}}}', None, [PARIS, SEARCH]),
    ("llama3", 'Here is JSON: {"name": "x"}', 'Here is JSON: {"name": "x"}', []),
    ("llama3", '{"answer": 42}', '{"answer": 42}', []),
    ("harmony", "<|channel|>analysis<|message|>The user wants weather.<|end|><|start|>assistant<|channel|>commentary "
                'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", "days": 3}<|call|>', None, [PARIS]),
    ("harmony", "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>It is 4.<|return|>",
     "It is 4.", []),
    ("harmony", "<|channel|>commentary<|message|>Checking both.<|end|><|start|>assistant to=functions.get_weather"
                '<|channel|>commentary json<|message|>{"city": "Paris", "days": 3}<|call|><|start|>assistant<|channel|>'
                'commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Rome"}<|call|>',
     "Checking both.", [PARIS, ROME]),
    ("kimi_k2", "Checking.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
                '{"city": "Paris", "days": 3}<|tool_call_end|><|tool_call_begin|>functions.get_weather:1'
                '<|tool_call_argument_begin|>{"city": "Rome"}<|tool_call_end|><|tool_calls_section_end|>',
     "Checking.", [PARIS, ROME]),
    ("glm", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n"
            "<arg_value>3</arg_value>\n</tool_call><tool_call>get_weather<arg_key>city</arg_key><arg_value>Rome"
            "</arg_value></tool_call>", None, [PARIS, ROME]),
    ("glm", 'Let me search.\n<tool_call>search\n<arg_key>query</arg_key>\n<arg_value>a < b; c</arg_value>\n'
            '<arg_key>filters</arg_key>\n<arg_value>{"k": [1, 2]}</arg_value>\n</tool_call>', "Let me search.", [SEARCH]),
    ("minimax_m2", 'Checking.\n<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n'
                   '<parameter name="days">3</parameter>\n</invoke>\n<invoke name="get_weather">\n'
                   '<parameter name="city">Rome</parameter>\n</invoke>\n</minimax:tool_call>', "Checking.", [PARIS, ROME]),
    ("deepseek_v3", "Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                    '{"city": "Paris", "days": 3}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>', "Sure.", [PARIS]),
    ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Paris\", \"days\": 3}"
                    "<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Rome\"}<｜tool▁call▁end｜>"
                    "<｜tool▁calls▁end｜>", None, [PARIS, ROME]),
]

# Calls cut short or broken: the text comes back as content, whole.
MALFORMED = [
    ("hermes", 'Hi <tool_call>\n{"name": "get_weather", "arguments": {"city": '),  # cut short (max_tokens)
    ("hermes", "<tool_call>\nnot json\n</tool_call>"),
    ("hermes", '<tool_call>\n{"arguments": {}}\n</tool_call>'),  # no name
    ("qwen3_coder", "<tool_call>\n<parameter=city>\nParis\n</parameter>\n</tool_call>"),  # no function
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Par'),
    ("harmony", "<|channel|>final<|message|>Hi<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather"
                "<|message|>{not json<|call|>"),
    ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{x"
                "<|tool_call_end|><|tool_calls_section_end|>"),
    ("glm", "<tool_call>get_weather\nstray text<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>"),
    ("minimax_m2", '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris'),
    ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>[1]<｜tool▁call▁end｜>"
                    "<｜tool▁calls▁end｜>"),
]


def calls_of(calls) -> list:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def streamed(fmt, text: str, rng: random.Random) -> list[dict]:
    """text fed to fmt's stream in random chunks (single characters often)."""
    stream, deltas, at = fmt.stream(TOOLS), [], 0
    while at < len(text):
        n = rng.choice([1, 1, 2, 3, 5, 8, 30])
        deltas += stream.feed(text[at:at + n])
        at += n
    return deltas + stream.finish()


@pytest.mark.parametrize("name,text,content,calls", RECORDED, ids=[f"{r[0]}-{i}" for i, r in enumerate(RECORDED)])
def test_recorded_answers_parse_whole_and_streamed(name, text, content, calls):
    fmt = FORMATS[name]
    got_content, got_calls = fmt.parse(text, TOOLS)
    assert (got_content, calls_of(got_calls)) == (content, calls)
    assert all(c.id for c in got_calls) and len({c.id for c in got_calls}) == len(got_calls)
    rng = random.Random(hash(text) % 1000)
    for _ in range(20):
        deltas = streamed(fmt, text, rng)
        s_content, s_calls = assemble(deltas)
        assert (s_content, calls_of(s_calls)) == (content, calls)
        # OpenAI's order: a call's id, type and name first (arguments ""), then its arguments.
        seen = set()
        for d in deltas:
            assert set(d) in ({"content"}, {"tool_calls"}), d
            for c in d.get("tool_calls", ()):
                if c["index"] not in seen:
                    assert c["type"] == "function" and c["id"] and c["function"]["name"], c
                    seen.add(c["index"])
                else:
                    assert set(c) == {"index", "function"} and set(c["function"]) == {"arguments"}
        assert sorted(seen) == list(range(len(calls)))


@pytest.mark.parametrize("name,text", MALFORMED, ids=[f"{r[0]}-{i}" for i, r in enumerate(MALFORMED)])
def test_malformed_calls_come_back_as_content(name, text):
    fmt = FORMATS[name]
    content, calls = fmt.parse(text, TOOLS)
    assert calls == [] and content
    if name != "harmony":  # harmony's content is its content messages' text
        assert content == text
    else:
        assert content == "Hi{not json"
    rng = random.Random(7)
    for _ in range(10):
        assert assemble(streamed(fmt, text, rng)) == (content, [])


def test_text_that_may_begin_a_call_is_held_back_until_decided():
    stream = FORMATS["hermes"].stream(TOOLS)
    assert stream.feed("It is <tool") == [{"content": "It is"}]  # "<tool" may open a call; " " touches it
    assert stream.feed("bar> here") == [{"content": " <toolbar> here"}]
    assert stream.finish() == []
    stream = FORMATS["hermes"].stream(TOOLS)
    assert stream.feed("Ok\n\n") == [{"content": "Ok"}]  # whitespace waits: a call may follow
    assert stream.feed("<tool_call>\n{") == []
    got = stream.feed('"name": "search", "arguments": {}}\n</tool_call>')
    assert [d["tool_calls"][0]["function"] for d in got] == [{"name": "search", "arguments": ""}, {"arguments": "{}"}]
    assert stream.feed("\n") == [] and stream.finish() == []


def test_parameter_values_are_typed_by_the_schema():
    fmt = FORMATS["qwen3_coder"]

    def one(value, schema):
        tools = {"f": {"type": "object", "properties": {"p": schema}}}
        _, calls = fmt.parse(f"<tool_call>\n<function=f>\n<parameter=p>\n{value}\n</parameter>\n</function>\n"
                             "</tool_call>", tools)
        return json.loads(calls[0].arguments)["p"]

    assert one("3", {"type": "integer"}) == 3 and one("3", {"type": "string"}) == "3"
    assert one("2.5", {"type": "number"}) == 2.5 and one("true", {"type": "boolean"}) is True
    assert one("[1, 2]", {"type": "array"}) == [1, 2] and one("null", {"type": ["integer", "null"]}) is None
    assert one("three", {"type": "integer"}) == "three"  # not an integer: what the model wrote
    assert one("3", {}) == "3"  # no type: a string
    _, calls = fmt.parse("<tool_call>\n<function=unknown>\n<parameter=p>\n3\n</parameter>\n</function>\n</tool_call>",
                         TOOLS)
    assert calls_of(calls) == [("unknown", {"p": "3"})]  # a tool not offered: its values stay text


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_a_call_pattern_matches_the_call_it_writes_and_parses_back(name):
    fmt = FORMATS[name]
    pattern = fmt.call_pattern("get_weather", TOOLS["get_weather"])
    assert (pattern.schema is None) != (pattern.arguments_regex is None)
    regex = re.compile(pattern.regex(whitespace=r"[ ]?"))
    if pattern.schema is not None:
        args = '{"city": "Paris", "days": 3}'
    else:
        args = {"qwen3_coder": "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n",
                "glm": "<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n"
                       "<arg_value>3</arg_value>\n",
                "minimax_m2": '<parameter name="city">Paris</parameter>\n<parameter name="days">3</parameter>\n'}[name]
    text = pattern.prefix + args + pattern.suffix
    assert regex.fullmatch(text), (regex.pattern, text)
    assert calls_of(fmt.parse(text, TOOLS)[1]) == [PARIS]
    assert not regex.fullmatch(text.replace("3", "three"))  # an integer parameter takes digits only
    if pattern.arguments_regex is not None:  # a required parameter cannot be left out
        assert not regex.fullmatch(pattern.prefix + pattern.suffix)


@pytest.mark.parametrize("model_type,template,want,known", [
    ("qwen3", "{% if tools %}<tools>...<tool_call>\n{\"name\": ...", "hermes", True),
    ("qwen3_5_moe", "{% if tools %}<tool_call>\n<function=example_function_name>", "qwen3_coder", True),
    ("qwen3_5", None, "qwen3_coder", True),
    ("llama", "{%- if tools %}<|python_tag|>{{ tool_call.arguments | tojson }}", "llama3", True),
    ("gpt_oss", "<|start|>assistant<|channel|>commentary", "harmony", True),
    ("kimi_k2", "<|tool_calls_section_begin|>", "kimi_k2", True),
    ("glm4_moe", "<tool_call>{{ tc.name }}<arg_key>", "glm", True),
    ("minimax_m2", "<minimax:tool_call>", "minimax_m2", True),
    ("deepseek_v3", "<｜tool▁calls▁begin｜>", "deepseek_v3", True),
    ("qwen3", None, "hermes", True),
    ("mistral", "[TOOL_CALLS]", "hermes", False),  # unknown: the hermes fallback
    (None, None, "hermes", False),
])
def test_format_for_reads_the_template_then_the_model_type(model_type, template, want, known):
    fmt, recognized = format_for(model_type, template)
    assert (fmt.name, recognized) == (want, known)


def test_a_decode_keeping_markers_keeps_the_formats_special_tokens_only():
    """`ServedModel.decode(ids, keep_markers=True)` skips every special token but the format's markers."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from infer.serve.model import marker_skips

    vocab = {"hi": 0, "x": 1, "<eos>": 2, "<|tool_calls_section_begin|>": 3, "<|tool_calls_section_end|>": 4,
             "<|im_end|>": 5, "[UNK]": 6}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<eos>", unk_token="[UNK]")
    tok.add_special_tokens({"additional_special_tokens": ["<|tool_calls_section_begin|>",
                                                          "<|tool_calls_section_end|>", "<|im_end|>"]})
    served = type("Served", (), {})()
    served.tokenizer, served.marker_skips = tok, marker_skips(tok, FORMATS["kimi_k2"])
    from infer.serve.model import ServedModel

    ids = [0, 3, 1, 4, 5, 2]
    assert ServedModel.decode(served, ids).split() == ["hi", "x"]
    assert ServedModel.decode(served, ids, keep_markers=True).replace(" ", "") == (
        "hi<|tool_calls_section_begin|>x<|tool_calls_section_end|>")
