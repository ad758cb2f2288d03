"""What a request may hold (`python -m infer.serve`): no request may crash the server, and no field is
silently ignored.

Everyday (no model): the sampling bounds' one home (`dflash_jax.engine.sampling.sampling_problem`),
the streaming engine refusing at `submit` what admission could not cast, the field policy
(`infer.serve.prepare.NOT_DONE`: no-op values accepted, others refused naming the field; unknown
fields with a hint), roles, chat template variables and a request's own template, the bounds,
an unexpected failure answered as an OpenAI-schema 500, and a fuzz of hostile bodies against the app
over a scripted engine that checks what reaches it as the real engine's submit and admission would.
The chat template path with the demo pair's real tokenizer (no weights).
"""

from __future__ import annotations

import json
import math
import queue
from types import SimpleNamespace

import numpy as np
import pytest

from dflash_jax.engine.sampling import INT32_MAX, MIN_TEMPERATURE, Sampling, SamplingError, check_sampling, \
    sampling_problem
from dflash_jax.errors import DFlashError
from infer.serve.prepare import (MAX_MESSAGES, MAX_STOP, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS, NOT_DONE,
                                 TEMPLATE_VARIABLES, prepare_request)
from infer.serve.protocol import APIError
from test_serve import CHAT, FakeEngine, fake_served

# ----------------------------------------------------------------------------- the sampling bounds


@pytest.mark.parametrize("temperature,top_k,top_p,field", [
    (0, 0, 1.0, None), (MIN_TEMPERATURE, INT32_MAX, 1.2e-38, None), (2.0, np.int64(5), 0.5, None),
    (1e-6, 0, 1.0, "temperature"), (-1, 0, 1.0, "temperature"), (math.nan, 0, 1.0, "temperature"),
    (math.inf, 0, 1.0, "temperature"), (True, 0, 1.0, "temperature"), ("1", 0, 1.0, "temperature"),
    (1.0, INT32_MAX + 1, 1.0, "top_k"), (1.0, -1, 1.0, "top_k"), (1.0, 1.5, 1.0, "top_k"), (1.0, True, 1.0, "top_k"),
    (1.0, 10**100, 1.0, "top_k"), (1.0, 0, 0.0, "top_p"), (1.0, 0, 1.5, "top_p"), (1.0, 0, math.nan, "top_p"), (1.0, 0, 1e-320, "top_p"),
])
def test_sampling_bounds_have_one_home(temperature, top_k, top_p, field):
    problem = sampling_problem(temperature, top_k, top_p)
    assert (problem and problem[0]) == field
    if field is None:
        check_sampling(temperature, top_k, top_p)
        assert Sampling(temperature, top_k, top_p).top_k == top_k
        return
    assert problem[1].startswith("must be") and "got" in problem[1]
    for make in (lambda: check_sampling(temperature, top_k, top_p), lambda: Sampling(temperature, top_k, top_p)):
        with pytest.raises(SamplingError) as e:
            make()
        assert e.value.field == field and str(e.value) == f"{field} {problem[1]}"
        assert isinstance(e.value, DFlashError)


def _admission_casts(req, context=64):
    """The casts `BatchEngine.admit` (and a long prompt's pieces) make of a request's values into
    numpy arrays: numpy raises OverflowError for an integer out of the dtype's range, which on the
    engine's thread would end the engine and the server."""
    tokens = np.zeros((1, context), np.int32)
    tokens[0, :len(req.prompt)] = req.prompt
    np.zeros((1,), np.uint32)[0] = req.row_id
    np.ones((1,), np.int32)[0] = req.max_new_tokens
    np.zeros((1,), np.int32)[0] = req.sampling.top_k
    for x in (req.sampling.temperature, req.sampling.top_p):
        assert np.isfinite(np.float32(x)) and (x == 0 or np.float32(x) > 0)


def _streaming_engine(vocab=1000, context=64, max_new=16, max_waiting=10**6):
    """A StreamingEngine (never started) over a model-free generator: its submit checks are the real ones."""
    from dflash_jax.engine.scheduler import BatchEngine
    from dflash_jax.engine.streaming import StreamingEngine

    spec = SimpleNamespace(sampling=Sampling(per_row=True), max_new_tokens=max_new, block_size=4, kv_pages=None,
                           target=SimpleNamespace(vocab_size=vocab, max_position_embeddings=context), max_logprobs=20)
    gen = SimpleNamespace(spec=spec, tail_widths=[], batch_size=2, max_prompt_len=context)
    gen.check_prompt = lambda prompt, n: BatchEngine.check_prompt(gen, prompt, n)
    gen.check_logprobs = lambda logprobs: BatchEngine.check_logprobs(gen, logprobs)
    return StreamingEngine(gen, max_waiting=max_waiting)


def test_submit_refuses_what_admission_could_not_cast():
    """A value that reached the engine out of range fails its request at submit (a DFlashError the
    server answers 400), before the engine's thread could meet it."""
    from dflash_jax.engine.streaming import StreamRequest

    engine = _streaming_engine()
    bad_k = Sampling(1.0, 5)
    object.__setattr__(bad_k, "top_k", INT32_MAX + 1)  # a Sampling altered after its own check
    bad_t = Sampling(1.0)
    object.__setattr__(bad_t, "temperature", math.nan)
    cases = [(StreamRequest([1, 2], 4, print, bad_k), "top_k"), (StreamRequest([1, 2], 4, print, bad_t), "temperature"),
             (StreamRequest([1, 2], 4, print, SimpleNamespace(temperature=1.0, top_k=0, top_p=1.0)), "Sampling"),
             (StreamRequest([1, 2**31], 4, print), "outside the vocabulary"),
             (StreamRequest([1, 2.5], 4, print), "integer token ids"), (StreamRequest("ab", 4, print), "integer"),
             (StreamRequest([1], True, print), "max_tokens"), (StreamRequest([1], 2**40, print), "max_tokens"),
             (StreamRequest([1], 4, print, row_id=2**32), "row id"), (StreamRequest([1], 4, print, row_id=-1), "row id")]
    for req, says in cases:
        with pytest.raises(DFlashError, match=says):
            engine.submit(req)
    with pytest.raises(OverflowError):  # what the engine's thread met with the issue's top_k
        _admission_casts(cases[0][0])
    assert engine._queued == 0 and engine._inbox.empty()  # nothing reached the engine's thread
    good = StreamRequest(np.array([1, 2]), 4, print, Sampling(0.5, INT32_MAX, 0.9, per_row=True), row_id=2**32 - 1)
    engine.submit(good)
    _admission_casts(good)
    assert engine._queued == 1 and engine._inbox.get_nowait() is good


# ----------------------------------------------------------------------------- the field policy


def refused(body, chat=False, served=None, status=400) -> APIError:
    with pytest.raises(APIError) as e:
        prepare_request(served or fake_served(), body, chat)
    err = e.value.body()["error"]
    assert e.value.status == status and list(err) == ["message", "type", "param", "code"] and err["message"]
    return e.value


def base(chat: bool) -> dict:
    return {"messages": CHAT} if chat else {"prompt": "x"}


def _not_a_noop(noops):
    return next(v for v in (5, "refused", {"a": 1}, [1], True) if not any(
        (isinstance(v, w) and not (w is not bool and isinstance(v, bool))) if isinstance(w, type) else
        (v is w if w is None or isinstance(w, bool) else type(v) is type(w) and v == w) for w in noops))


@pytest.mark.parametrize("name", sorted(NOT_DONE))
def test_every_known_field_not_done_is_accepted_at_its_no_op_and_refused_otherwise(name):
    from infer.serve.protocol import ChatCompletionRequest, CompletionRequest

    endpoints, noops, message = NOT_DONE[name]
    for chat in (False, True):
        endpoint = "chat" if chat else "completions"
        if name in (ChatCompletionRequest if chat else CompletionRequest).model_fields:
            continue  # a field this endpoint does (max_completion_tokens in chat)
        if endpoint not in endpoints:
            e = refused({**base(chat), name: None}, chat)
            assert e.param == name and f"not a {endpoint} field" in e.message
            continue
        for value in noops:
            value = {str: "x", dict: {"k": "v"}, bool: False}[value] if isinstance(value, type) else value
            job = prepare_request(fake_served(), {**base(chat), name: value}, chat)
            assert job.max_tokens == 16
        e = refused({**base(chat), name: _not_a_noop(noops)}, chat)
        assert (e.param, e.message) == (name, message)


@pytest.mark.parametrize("body,chat,param,says", [
    ({"logprobs": 21}, False, "logprobs", "logprobs must be an integer in 0..20, got 21"),
    ({"logprobs": -1}, False, "logprobs", "logprobs must be an integer in 0..20"),
    ({"logprobs": True, "top_logprobs": 21}, True, "top_logprobs", "top_logprobs must be an integer in 0..20"),
    ({"top_logprobs": 2}, True, "top_logprobs", "top_logprobs needs logprobs: true"),
    ({"prompt_logprobs": 1}, True, "prompt_logprobs", "prompt_logprobs are not supported"),
    ({"max_completion_tokens": 5}, False, "max_completion_tokens", "use max_tokens"),
    ({"response_format": {"type": "json_object"}}, True, "response_format", "structured output is off"),
    ({"response_format": {"type": "json_schema", "json_schema": {}}}, False, "response_format", "json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, False, "response_format", "type must be text, json_object or"),
    ({"structured_outputs": {"grammar": "root ::= x"}}, False, "structured_outputs", "context-free grammars"),
    ({"structured_outputs": {"regex": "a+", "choice": ["a"]}}, False, "structured_outputs", "exactly one of"),
    ({"guided_grammar": "root ::= x"}, False, "guided_grammar", "context-free grammars"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, False, "guided_regex", "a request takes one"),
    ({"tools": [{"type": "function", "function": {"name": "f g"}}]}, True, "tools", "function.name must be"),
    ({"tool_choice": "auto"}, True, "tool_choice", "tool_choice needs tools"),
    ({"functions": [{"name": "f"}]}, True, "functions", "send tools"),
    ({"function_call": "auto"}, True, "function_call", "send tool_choice"),
    ({"logit_bias": {"5": 101}}, False, "logit_bias", "100"),
    ({"logit_bias": {"x": 1}}, False, "logit_bias", "token ids below"),
    ({"presence_penalty": 0.5}, True, "presence_penalty", "only 0"),
    ({"frequency_penalty": -1}, False, "frequency_penalty", "only 0"),
    ({"frequency_penalty": False}, False, "frequency_penalty", "only 0"),  # False is not 0
    ({"repetition_penalty": 1.2}, False, "repetition_penalty", "only 1"),
    ({"min_p": 0.1}, False, "min_p", "only 0"),
    ({"min_tokens": 3}, True, "min_tokens", "only 0"),
    ({"include_stop_str_in_output": True}, False, "include_stop_str_in_output", "not supported"),
    ({"best_of": 2}, True, "best_of", "best_of = 1"),
    ({"suffix": "x"}, True, "suffix", "not a chat field"),
    ({"stop_sequences": ["\n"]}, False, "stop_sequences", "unknown field 'stop_sequences'; did you mean 'stop'?"),
    ({"temprature": 0.5}, True, "temprature", "did you mean 'temperature'?"),
    ({"max_new_tokens": 5}, False, "max_new_tokens", "did you mean 'max_tokens'?"),
    ({"frobnicate": 1}, False, "frobnicate", "unknown field 'frobnicate'"),
    ({"stream_options": {"include_usge": True}}, False, "stream_options",
     "unknown field 'include_usge' in stream_options; did you mean 'include_usage'?"),
    ({"stream_options": {"continuous_usage_stats": True}}, True, "stream_options", "not supported"),
    ({"x" * 10000: 1}, False, "x" * 40 + "...", "unknown field 'xxxxx"),
])
def test_fields_the_server_does_not_do_are_refused_naming_them(body, chat, param, says):
    e = refused({**base(chat), **body}, chat)
    assert e.param == param and says in e.message, e.message
    assert len(e.message) < 200  # a long name is cut short in the message
    if "did you mean" not in says and "unknown" in says:
        assert "did you mean" not in e.message


def test_harmless_fields_are_accepted_at_their_no_op_values():
    served = fake_served()
    noop = {"user": "u", "stream_options": {"include_usage": True, "include_obfuscation": False,
                                            "continuous_usage_stats": False}, "service_tier": "auto", "metadata": {"a": "b"},
            "store": False, "logprobs": False, "echo": False, "best_of": 1, "frequency_penalty": 0,
            "presence_penalty": 0.0, "repetition_penalty": 1, "min_p": 0, "min_tokens": 0, "logit_bias": {},
            "response_format": {"type": "text"}, "include_stop_str_in_output": False, "skip_special_tokens": True}
    for chat in (False, True):
        job = prepare_request(served, {**base(chat), **noop}, chat)
        assert job.max_tokens == 16 and not job.include_usage  # include_usage only in a stream
    chat_noop = {"top_logprobs": None, "tools": [], "tool_choice": "none", "parallel_tool_calls": True,
                 "add_generation_prompt": True, "continue_final_message": False}
    prepare_request(served, {**base(True), **chat_noop}, True)
    prepare_request(served, {**base(False), "logprobs": None, "suffix": None}, False)


@pytest.mark.parametrize("message,says", [
    ({"role": "wizard", "content": "x"}, "role must be one of system, developer, user, assistant, tool; got 'wizard'"),
    ({"role": "tool", "content": "x", "tool_call_id": "1"}, "tool_call_id '1' answers no earlier"),
    ({"role": "function", "content": "x"}, "function messages are not supported"),
    ({"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function"}]}, "tool_calls[0] must be"),
    ({"role": "user", "content": "x", "tool_call_id": "1"}, "tool_call_id belongs to a tool message"),
    ({"role": "user", "content": "x", "nmae": "a"}, "unknown field 'nmae' in messages[1]; did you mean 'name'?"),
    ({"role": "user", "content": [{"type": "text", "text": "x", "cache": 1}]}, "in messages[1].content[0]"),
    ({"role": "r" * 5000, "content": "x"}, "got 'rrrr"),
])
def test_chat_messages_are_checked(message, says):
    e = refused({"messages": [CHAT[0], message]}, True)
    assert e.param == "messages[1]" and says in e.message and len(e.message) < 200, e.message


def test_chat_messages_accepted_as_the_template_takes_them():
    served = fake_served()
    messages = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "x", "name": "ann"},
                {"role": "assistant", "content": "y", "tool_calls": [], "refusal": None}]
    prepare_request(served, {"messages": messages}, True)
    assert served.chats[-1][0] == [{"role": "system", "content": "be brief"},  # developer: the system turn
                                   {"role": "user", "content": "x", "name": "ann"}, {"role": "assistant", "content": "y"}]


@pytest.mark.parametrize("kwargs,says", [
    ({"padding": "max_length", "max_length": 10**9}, "'padding' is not a chat template variable"),
    ({"return_tensors": "np"}, "'return_tensors' is not a chat template variable"),
    ({"tokenize": False}, "'tokenize'"), ({"truncation": True}, "'truncation'"),
    ({"add_generation_prompt": False}, "'add_generation_prompt'"), ({"tools": []}, "'tools'"),
    ({"enable_thinking": [1, 2]}, "enable_thinking must be a boolean, a number or a string"),
    ({"enable_thinking": {"a": 1}}, "enable_thinking must be"),
    ({"reasoning_effort": "x" * 1000}, "at most 256 characters"), ({"thinking": 10**30}, "thinking must be"),
])
def test_chat_template_kwargs_are_template_variables_only(kwargs, says):
    served = fake_served()
    e = refused({"messages": CHAT, "chat_template_kwargs": kwargs}, True, served)
    assert e.param == "chat_template_kwargs" and says in e.message, e.message
    assert not served.chats  # the template never ran


def test_chat_template_kwargs_allowed_reach_the_template():
    served = fake_served()
    kwargs = {"enable_thinking": False, "thinking": True, "reasoning_effort": "low"}
    assert set(kwargs) == set(TEMPLATE_VARIABLES)
    prepare_request(served, {"messages": CHAT, "chat_template_kwargs": kwargs}, True)
    assert served.chats[-1] == (CHAT, kwargs)


def test_a_requests_chat_template_needs_the_servers_trust():
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    for body, param in (({"chat_template": template}, "chat_template"),
                        ({"chat_template_kwargs": {"chat_template": template}}, "chat_template_kwargs")):
        served = fake_served()
        e = refused({"messages": CHAT, **body}, True, served)
        assert e.param == param and "--trust-request-chat-template" in e.message and not served.chats
        served.trust_request_chat_template = True
        prepare_request(served, {"messages": CHAT, **body}, True)
        assert served.chats == [(CHAT, {}, template)]
    served = fake_served()
    served.trust_request_chat_template = True
    e = refused({"messages": CHAT, "chat_template_kwargs": {"chat_template": 5}}, True, served)
    assert e.param == "chat_template_kwargs" and "must be a string" in e.message
    assert refused({"messages": CHAT, "chat_template": 5}, True, served).param == "chat_template"


@pytest.mark.parametrize("body,chat,param,says", [
    ({"top_k": 2**31}, False, "top_k", f"0..{INT32_MAX}"), ({"top_k": 10**100}, True, "top_k", "top_k must be"),
    ({"temperature": 1e-7}, False, "temperature", "from 1e-05 up"),
    ({"stop": ["s"] * (MAX_STOP + 1)}, False, "stop", f"at most {MAX_STOP}"),
    ({"stop": "s" * (MAX_STOP_CHARS + 1)}, True, "stop", f"at most {MAX_STOP_CHARS} characters"),
    ({"stop": ["s"] * 10000}, False, "stop", "10000 strings"),
    ({"stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + 1)}, False, "stop_token_ids", "at most"),
    ({"stop_token_ids": [1000]}, False, "stop_token_ids", "outside the vocabulary (0..999)"),
    ({"stop_token_ids": [-1]}, True, "stop_token_ids", "outside the vocabulary"),
    ({"stop_token_ids": [10**100]}, False, "stop_token_ids", "outside the vocabulary"),
    ({"messages": CHAT * (MAX_MESSAGES + 1)}, True, "messages", f"at most {MAX_MESSAGES}"),
    ({"model": "m" * 257}, False, "model", "at most 256 characters"),
    ({"prompt": "\ud800"}, False, "prompt", "lone surrogate (\\ud800)"),
    ({"model": "a\udfff"}, True, "model", "lone surrogate (\\udfff)"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]}, True, "messages[0]",
     "messages[0].content[0].text holds a lone surrogate"),
    ({"stop": ["ok", "\ud800"]}, False, "stop", "stop[1] holds"),
])
def test_bounds(body, chat, param, says):
    e = refused({**base(chat), **body}, chat)
    assert e.param == param and says in e.message, e.message
    json.dumps(e.body()).encode("utf-8")  # the answer can be sent


def test_bounds_at_their_edges_are_accepted():
    served = fake_served()
    job = prepare_request(served, {"prompt": "x", "top_k": INT32_MAX, "seed": 10**100, "stop": ["s" * MAX_STOP_CHARS]
                                   * MAX_STOP, "stop_token_ids": list(range(MAX_STOP_TOKEN_IDS)),
                                   "temperature": MIN_TEMPERATURE}, False)
    assert job.sampling.top_k == INT32_MAX and job.row_id == 10**100 % 2**32
    assert prepare_request(served, {"prompt": "x", "seed": -10**100}, False).row_id == -10**100 % 2**32
    assert prepare_request(served, {"prompt": "x", "top_k": 5000}, False).sampling.top_k == 5000  # >= vocab: off
    prepare_request(served, {"messages": CHAT * MAX_MESSAGES, "stop_token_ids": [999]}, True)


# ----------------------------------------------------------------------------- the app


class GuardedEngine(FakeEngine):
    """The scripted engine, but a request reaches it only through a real StreamingEngine's submit
    checks and then through admission's casts: anything that would fail on the real engine's
    thread fails the test instead."""

    def __init__(self):
        super().__init__()
        self.real, self.reached = _streaming_engine(), 0

    def check(self, prompt, max_new_tokens):
        return self.real.check(prompt, max_new_tokens)

    def submit(self, req):
        self.real.submit(req)
        assert self.real._inbox.get_nowait() is req
        self.real._queued -= 1
        _admission_casts(req)
        self.reached += 1
        super().submit(req)


NUMERIC = ["max_tokens", "max_completion_tokens", "n", "temperature", "top_p", "top_k", "seed", "best_of", "logprobs",
           "top_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens"]
HOSTILE = [2**31, 2**31 - 1, 2**32, 2**63, 2**64, 10**100, -1, -(2**31) - 1, -(10**100), 0, 0.5, 1.5, 1e308, -1e308,
           1e-320, True, False, None, "1", "", [], {}, [1], {"x": 1}, [[[[1]]]]]


def hostile_bodies():
    """(path, raw body bytes) pairs: each endpoint's hostile requests."""
    out = []
    add = lambda chat, body: out.append(("/v1/chat/completions" if chat else "/v1/completions",
                                         body if isinstance(body, bytes) else
                                         json.dumps(body).encode("utf-8", "surrogatepass")))
    for chat in (False, True):
        ok = {"messages": CHAT} if chat else {"prompt": "def f(x):"}
        for raw in (b"", b"null", b"1", b"[]", b'"x"', b"true", b"{", b"[" * 100000, b'{"prompt": "x"} junk',
                    b'{"prompt": "\xff\xfe"}', b"\xff", b"{" * 5000 + b"}" * 5000, b'{"a": ' * 3000 + b"1" + b"}" * 3000,
                    b"[" * 500 + b"]" * 500, b'{"prompt": [' + b"1," * 20000 + b'1]}'):
            add(chat, raw)
        for name in NUMERIC:
            for value in HOSTILE:
                add(chat, {**ok, "max_tokens": 2, name: value})
            for literal in (b"NaN", b"Infinity", b"-Infinity", b"1" * 4000, b"1" * 5000):
                add(chat, json.dumps({**ok, "max_tokens": 2}).encode()[:-1] + b', "' + name.encode() + b'": ' + literal
                    + b"}")
        for name in ("stop", "stop_token_ids", "stream", "stream_options", "return_token_ids", "model", "user",
                     "logit_bias", "response_format", "tools", "tool_choice", "chat_template_kwargs", "chat_template",
                     "suffix", "echo", "include_stop_str_in_output", "metadata"):
            for value in ([None], [1.5], [True], [2**31], [-1], [10**100], "\ud800",
                          ["\udc00"], {"\ud800": 1}, {"include_usage": "yes"}, 1, "yes", [[["x"]]], {"type": "json_object"},
                          {"padding": "max_length", "max_length": 10**9}, {"return_tensors": "np"},
                          "{% for i in range(3000) %}{% for j in range(3000) %}x{% endfor %}{% endfor %}"):
                add(chat, {**ok, "max_tokens": 2, name: value})
        for key in ("stop_sequences", "", "\ud800", "k" * 10000, "prompt ", "Prompt"):
            add(chat, {**ok, key: 1})
            add(chat, {**ok, key: "\ud800"})
            add(chat, {**ok, "metadata": {key: {"a": [["\udc00"]]}}})
        for name, value in (("stop", ["s"] * 10000), ("stop", "s" * 100000), ("stop_token_ids", [1] * 10000),
                            ("user", "u" * 100000), ("metadata", {str(i): i for i in range(10000)})):
            add(chat, {**ok, "max_tokens": 2, name: value})
        add(chat, {**ok, "stream": True, "top_k": 2**31})
        add(chat, {**ok, "stream": True, "n": 65, "stop": ["a"] * 17})
    for prompt in ("\ud800", "x\udfff", [2**31], [-1], [10**100], [], "", [[1, 2], [3]], [["x"]], [1] * 20000,
                   [True], {"x": 1}, [1.0], [[]], [[2**31]], [None], ["\ud800"]):
        add(False, {"prompt": prompt, "max_tokens": 2})
    for messages in (None, "x", [], [None], [1], [[]], [{"role": "wizard", "content": "x"}], [{"role": 1}],
                     [{"role": None, "content": "x"}], [{"role": "user", "content": 1}], [{"content": "x"}],
                     [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
                     [{"role": "user", "content": [{"type": "text"}]}],
                     [{"role": "user", "content": [{"type": "text", "text": 1}]}],
                     [{"role": "user", "content": [{"type": "text", "text": "x", "extra": 1}]}],
                     [{"role": "user", "content": [None]}], [{"role": "user", "content": {"text": "x"}}],
                     [{"role": "tool", "content": "x", "tool_call_id": "1"}],
                     [{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}],
                     [{"role": "user", "content": "x", "unknown": 1}], [{"role": "user", "content": "x"}] * 5000,
                     [{"role": "user", "content": "\ud800"}], [{"role": "\ud800", "content": "x"}],
                     [{"role": "user", "content": "x", "name": 5}], [{"role": "r" * 100000, "content": "x"}]):
        add(True, {"messages": messages, "max_tokens": 2})
    return out


def check_answer(r, where):
    """An answer the client can read: never a 5xx, never plain text; an error in OpenAI's schema."""
    assert r.status_code < 500, (where, r.status_code, r.text[:300])
    kind = r.headers["content-type"]
    if r.status_code == 200:
        assert kind.startswith(("application/json", "text/event-stream")), (where, kind)
        return
    assert kind.startswith("application/json"), (where, r.status_code, kind, r.text[:300])
    err = r.json()["error"]
    assert list(err) == ["message", "type", "param", "code"] and isinstance(err["message"], str) and err["message"]
    assert err["type"] == "invalid_request_error" and (err["param"] is None or isinstance(err["param"], str)), where
    assert len(r.content) < 4000, (where, r.text[:300])  # an error quotes nothing long


def test_fuzz_hostile_bodies_never_crash_the_server():
    """Over a thousand hostile bodies (in process, over httpx's ASGI transport): every answer a 200
    or an OpenAI-schema 4xx; every request that reached the engine passed the real engine's submit
    checks and admission's casts; after them all, a normal request still answers 200 and /health 200."""
    import asyncio

    import httpx

    from infer.serve.app import create_app

    served = fake_served()
    served.engine, served.context = GuardedEngine(), 64
    bodies = hostile_bodies()
    statuses = {}

    async def run():
        transport = httpx.ASGITransport(app=create_app(served))
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as client:
            for path, raw in bodies:
                r = await client.post(path, content=raw)
                check_answer(r, (path, raw[:120]))
                statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            ok = await client.post("/v1/completions", json={"prompt": "def f(x):", "max_tokens": 4})
            assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "bde"
            assert (await client.post("/v1/chat/completions", json={"messages": CHAT})).status_code == 200
            assert (await client.get("/health")).status_code == 200

    asyncio.run(run())
    assert len(bodies) > 1000 and statuses.get(400, 0) > len(bodies) // 2, statuses
    assert served.engine.reached >= statuses.get(200, 0), statuses
    assert not served.chats or all(set(kwargs) <= set(TEMPLATE_VARIABLES) for _, kwargs, *_ in served.chats)


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "def f(x):", "max_tokens": 4, "top_k": 2147483648}, "top_k"),
    ("/v1/completions", {"prompt": "\ud800"}, "prompt"),
    ("/v1/completions", {"prompt": "x", "model": "\ud800"}, "model"),
    ("/v1/chat/completions", {"messages": CHAT, "chat_template_kwargs": {"return_tensors": "np"}},
     "chat_template_kwargs"),
    ("/v1/chat/completions", {"messages": CHAT, "chat_template_kwargs": {"padding": "max_length",
                                                                         "max_length": 1000000000}},
     "chat_template_kwargs"),
    ("/v1/chat/completions", {"messages": CHAT, "chat_template": "{% for i in range(3000) %}x{% endfor %}"},
     "chat_template"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0]"),
    ("/v1/completions", {"prompt": "x", "stop_sequences": ["\n"]}, "stop_sequences"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
])
def test_the_issues_bodies_are_400_naming_the_field(path, body, param):
    from starlette.testclient import TestClient

    from infer.serve.app import create_app

    served = fake_served()
    served.engine, served.context = GuardedEngine(), 64
    with TestClient(create_app(served)) as client:
        r = client.post(path, content=json.dumps(body).encode("utf-8", "surrogatepass"))
        check_answer(r, body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
    assert served.engine.reached == 1 and not served.chats


def test_an_unexpected_failure_is_an_openai_schema_500():
    """A bug (here: the tokenizer raising) answers a JSON 500 of type server_error, not plain text;
    the next request is served."""
    from starlette.testclient import TestClient

    from infer.serve.app import create_app

    served = fake_served()
    served.engine, served.context = FakeEngine(), 64
    encode = served.encode
    calls = queue.SimpleQueue()

    def flaky(prompt):
        if calls.empty():
            calls.put(1)
            raise RuntimeError("a bug")
        return encode(prompt)

    served.encode = flaky
    with TestClient(create_app(served), raise_server_exceptions=False) as client:
        r = client.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 500 and r.headers["content-type"].startswith("application/json")
        err = r.json()["error"]
        assert err["type"] == "server_error" and err["message"] and "a bug" not in err["message"]
        assert client.post("/v1/completions", json={"prompt": "x"}).status_code == 200


# ----------------------------------------------------------------------------- the real template


def test_served_chat_with_the_demo_tokenizer():
    """ServedModel.chat over the demo pair's tokenizer and chat template (no weights): the template
    variables pass, a trusted request template renders instead, a template's own error is a 400."""
    from dflash_jax.pair import DEMO_DIR, load_tokenizer
    from infer.serve.model import ServedModel

    tok = load_tokenizer(DEMO_DIR / "target")
    model = SimpleNamespace(tokenizer=tok, thinking=False)
    chat = lambda *a: ServedModel.chat(model, *a)
    plain = chat(CHAT, {})
    assert plain and all(isinstance(t, int) for t in plain)
    assert chat(CHAT, {"enable_thinking": False, "reasoning_effort": "low"}) == plain  # variables the template ignores
    own = chat(CHAT, {}, "{% for m in messages %}{{ m.content }}{% endfor %}")
    assert own == tok("hi", add_special_tokens=False)["input_ids"]
    with pytest.raises(APIError) as e:
        chat(CHAT, {}, "{{ raise_exception('no') }}")
    assert e.value.status == 400 and e.value.param == "messages" and "no" in e.value.message


def test_every_field_of_the_openai_clients_requests_is_known():
    """Each field of the openai client's own request types (completions and chat) is either one the
    server's request models take or one `NOT_DONE` names (refused unless at a no-op value): none can
    reach the server unknown, let alone be ignored."""
    from openai.types import completion_create_params as completions
    from openai.types.chat import completion_create_params as chat

    from infer.serve.protocol import ChatCompletionRequest, CompletionRequest

    for params, model, endpoint in ((completions, CompletionRequest, "completions"),
                                    (chat, ChatCompletionRequest, "chat")):
        fields = set(params.CompletionCreateParamsBase.__annotations__)
        known = set(model.model_fields) | {k for k, (where, _, _) in NOT_DONE.items() if endpoint in where}
        assert fields - known == set(), endpoint
        assert len(fields) > 15  # the types were read


def test_logit_bias_reaches_the_rows_tokens():
    """A request's logit_bias is its row's (`Sampling.logit_bias` -> `rows_of` -> the processor):
    +100 on one token makes a greedy row emit only it; the row beside it is untouched."""
    from dflash_jax.engine import BatchEngine
    from fixtures import sampling_setup

    prepared = prepare_request(fake_served(), {**base(False), "temperature": 0, "logit_bias": {"7": 100}}, False)
    assert prepared.sampling.logit_bias == ((7, 100),)
    target, tparams, drafter, dparams = sampling_setup()
    gen = BatchEngine(target, tparams, drafter, dparams, block_size=4, batch_size=2, max_new_tokens=8,
                      max_prompt_len=16, sampling=Sampling(per_row=True), speculation="fixed")
    rows = [prepared.sampling, Sampling(per_row=True)]
    out = sorted(gen.generate([[3, 1, 4], [3, 1, 4]], sampling=rows), key=lambda r: r.index)
    assert set(out[0].output_ids) == {7} and set(out[1].output_ids) != {7}
