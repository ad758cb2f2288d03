"""`python -m infer.serve`: the OpenAI-compatible server over the streaming engine.

Everyday (no model, well under a second each): a request's checks and defaults (`prepare_request`), the
release of a row's text as it grows with stop strings held back (`StreamedText`), /metrics'
Prometheus text (`render_metrics`), and the app over a scripted fake engine (the response and
event-stream schema, stop strings cancelling the row, 400/401/429/503/500).

Heavy (`-m heavy`): one server of the demo pair (`--max-prompt-len 64 --batch-size 4
--max-waiting 80`) started once for the file and driven with the real `openai` client:
concurrent greedy streams equal `python -m infer` token for token and in text, seeded sampling
is the same alone or among others, chat, the error schema, abandoned streams free their slots,
64 concurrent clients, a full queue answers 429, and SIGTERM with a stream in flight lets it
finish, refuses new connections and exits 0 (the last test; the fixture's teardown sends
SIGTERM otherwise and checks the same exit).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from infer.serve.metrics import render_metrics
from infer.serve.prepare import prepare_request
from infer.serve.protocol import APIError
from infer.serve.streaming import StreamedText

REPO = Path(__file__).resolve().parent.parent
MODEL = "dflash-demo"  # the demo pair's served name
heavy = pytest.mark.heavy
START_TIMEOUT = 300  # seconds for the server to load and compile (about 40 s warm, 2 min with no compile cache)
TIMEOUT = 60  # seconds for one HTTP operation

# ----------------------------------------------------------------------------- everyday: prepare_request


def fake_served(check=lambda ids, n: None, max_new=16):
    """What prepare_request and StreamedText use of a ServedModel, without a model: a character-per-token "tokenizer"."""
    chats = []

    def chat(messages, kwargs, template=None):
        chats.append((messages, kwargs) if template is None else (messages, kwargs, template))
        return [7, 8, 9]

    from infer.serve.toolcalls.request import ModelTools

    return SimpleNamespace(name="m", max_new=max_new, encode=lambda p: p if isinstance(p, list) else [ord(c) for c in p],
                           chat=chat, chats=chats, decode=decode, engine=SimpleNamespace(check=check),
                           token_piece=lambda i: (decode([i]), list(decode([i]).encode())),
                           vocab_size=1000, trust_request_chat_template=False, constraints=None,
                           constraint_refusal="structured output is off on this server (--constraint-states 0)",
                           tools=ModelTools.of("qwen3", "{% for t in tools %}<tool_call>{% endfor %}"))


CHAT = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("body,chat,status,param", [
    ([], False, 400, None),
    ({"prompt": "x", "model": "other"}, False, 404, "model"),
    ({"prompt": "x", "n": 65}, False, 400, "n"),
    ({"prompt": "x", "n": 0}, False, 400, "n"),
    ({"prompt": "x", "best_of": 3}, False, 400, "best_of"),
    ({"prompt": "x", "logprobs": 21}, False, 400, "logprobs"),
    ({"prompt": "x", "logprobs": True}, False, 400, "logprobs"),
    ({"messages": CHAT, "logprobs": True, "top_logprobs": 21}, True, 400, "top_logprobs"),
    ({"messages": CHAT, "top_logprobs": 2}, True, 400, "top_logprobs"),
    ({"messages": CHAT, "logprobs": 1}, True, 400, "logprobs"),
    ({"prompt": "x", "prompt_logprobs": 1}, False, 400, "prompt_logprobs"),
    ({"prompt": "x", "echo": True}, False, 400, "echo"),
    ({"prompt": "x", "suffix": "y"}, False, 400, "suffix"),
    ({"prompt": ["a", "b"]}, False, 400, "prompt"),
    ({"prompt": [1, "a"]}, False, 400, "prompt"),
    ({"prompt": [1, True]}, False, 400, "prompt"),
    ({"prompt": None}, False, 400, "prompt"),
    ({"prompt": 5}, False, 400, "prompt"),
    ({"prompt": "x", "max_tokens": 17}, False, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": 0}, False, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": "5"}, False, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": True}, False, 400, "max_tokens"),
    ({"messages": CHAT, "max_completion_tokens": 17}, True, 400, "max_tokens"),
    ({"prompt": "x", "temperature": -1}, False, 400, "temperature"),
    ({"prompt": "x", "temperature": 2.5}, False, 400, "temperature"),
    ({"prompt": "x", "temperature": "hot"}, False, 400, "temperature"),
    ({"prompt": "x", "top_p": 0}, False, 400, "top_p"),
    ({"prompt": "x", "top_p": 1.5}, False, 400, "top_p"),
    ({"prompt": "x", "top_k": -2}, False, 400, "top_k"),
    ({"prompt": "x", "seed": 1.5}, False, 400, "seed"),
    ({"prompt": "x", "stop": [""]}, False, 400, "stop"),
    ({"prompt": "x", "stop": 5}, False, 400, "stop"),
    ({"prompt": "x", "stop_token_ids": "x"}, False, 400, "stop_token_ids"),
    ({"prompt": "x", "stop_token_ids": [1.0]}, False, 400, "stop_token_ids"),
    ({"prompt": "x", "stream": True, "stream_options": "x"}, False, 400, "stream_options"),
    ({"messages": []}, True, 400, "messages"),
    ({"prompt": "x"}, True, 400, "messages"),  # a chat request needs messages
    ({"messages": [{"content": "x"}]}, True, 400, "messages[0]"),
    ({"messages": CHAT + ["x"]}, True, 400, "messages[1]"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, True, 400, "messages[0]"),
    ({"messages": [{"role": "user", "content": 5}]}, True, 400, "messages[0]"),
    ({"messages": CHAT, "chat_template_kwargs": "x"}, True, 400, "chat_template_kwargs"),
])
def test_job_refuses_bad_requests_in_openai_schema(body, chat, status, param):
    with pytest.raises(APIError) as e:
        prepare_request(fake_served(), body, chat)
    assert e.value.status == status and e.value.param == param
    err = e.value.body()["error"]
    assert list(err) == ["message", "type", "param", "code"] and err["message"] and err["param"] == param
    assert err["type"] == "invalid_request_error"
    if status == 404:
        assert err["code"] == "model_not_found" and "'other'" in err["message"] and "'m'" in err["message"]


def test_job_defaults_and_fields():
    served = fake_served()
    job = prepare_request(served, {"prompt": "hi"}, chat=False)
    assert job.prompt_ids == [104, 105] and job.max_tokens == 16  # the server's limit by default
    assert (job.sampling.temperature, job.sampling.top_k, job.sampling.top_p) == (1.0, 0, 1.0)  # OpenAI's defaults
    assert job.sampling.per_row and 0 <= job.row_id < 2**32
    assert job.stop == [] and job.stop_ids == set() and not job.stream and not job.include_usage
    assert not job.return_token_ids and not job.chat

    job = prepare_request(served, {"prompt": [[3, 4]], "model": "m", "n": 1, "max_tokens": 16, "temperature": 0,
                                   "top_p": 0.5, "top_k": -1, "seed": 2**32 + 5, "stop": "\n", "stop_token_ids": [2],
                                   "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True,
                                   "logprobs": None}, False)
    assert job.prompt_ids == [3, 4] and job.max_tokens == 16 and job.row_id == 5  # a seed modulo 2**32
    assert (job.sampling.temperature, job.sampling.top_k, job.sampling.top_p) == (0.0, 0, 0.5)
    assert job.stop == ["\n"] and job.stop_ids == {2} and job.stream and job.include_usage and job.return_token_ids
    assert prepare_request(served, {"prompt": ["ab"], "top_k": 40}, False).prompt_ids == [97, 98]  # a batch of one
    assert prepare_request(served, {"prompt": "x", "top_k": 40}, False).sampling.top_k == 40
    assert not prepare_request(served, {"prompt": "x", "stream_options": {"include_usage": True}},
                               False).include_usage
    # The same seed, the same random stream; none: a fresh one each time.
    seeded = lambda: prepare_request(served, {"prompt": "x", "seed": 9}, False).row_id
    assert seeded() == seeded()
    assert len({prepare_request(served, {"prompt": "x"}, False).row_id for _ in range(8)}) > 1


def test_job_chat_messages_and_template_kwargs():
    served = fake_served()
    messages = [{"role": "system", "content": None},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "name": "x"}]
    job = prepare_request(served, {"messages": messages, "max_tokens": 3, "max_completion_tokens": 5,
                       "chat_template_kwargs": {"enable_thinking": False}}, chat=True)
    assert job.chat and job.prompt_ids == [7, 8, 9] and job.max_tokens == 5  # max_completion_tokens wins
    assert served.chats == [([{"role": "system", "content": ""}, {"role": "user", "content": "ab", "name": "x"}],
                             {"enable_thinking": False})]  # a message's name goes to the template
    assert prepare_request(served, {"messages": CHAT, "max_tokens": 3}, chat=True).max_tokens == 3
    assert prepare_request(served, {"messages": CHAT}, chat=True).max_tokens == 16


def test_job_reports_the_engines_refusal():
    too_long = lambda ids, n: "prompt of 100 tokens is longer than the context (64 tokens)"
    for chat, body, param in ((False, {"prompt": [1] * 100}, "prompt"), (True, {"messages": CHAT}, "messages")):
        with pytest.raises(APIError) as e:
            prepare_request(fake_served(check=too_long), body, chat)
        assert (e.value.status, e.value.param, e.value.code) == (400, param, "context_length_exceeded")
        assert "longer than the context" in e.value.message
    with pytest.raises(APIError) as e:
        prepare_request(fake_served(check=lambda ids, n: "token id 99999 outside the vocabulary (size 10)"),
                        {"prompt": [99999]}, False)
    assert (e.value.status, e.value.code) == (400, None) and "outside the vocabulary" in e.value.message


# ----------------------------------------------------------------------------- everyday: StreamedText


def decode(ids):
    """A tokenizer-free decode: token i is a letter (2: newline); 9 then 10 are the two halves of
    one character ("é"), and a lone 9 decodes to the replacement character."""
    out, i = [], 0
    while i < len(ids):
        t = ids[i]
        if t == 9:
            out.append("é" if i + 1 < len(ids) and ids[i + 1] == 10 else "\ufffd")
            i += 2 if i + 1 < len(ids) and ids[i + 1] == 10 else 1
            continue
        out.append("\n" if t == 2 else "" if t == 10 else chr(97 + t % 26))
        i += 1
    return "".join(out)


def decoded(stop=(), stop_ids=()):
    return StreamedText(fake_served(), SimpleNamespace(stop=list(stop), stop_ids=set(stop_ids)))


def test_decoded_holds_back_a_possible_stop_string_and_cuts_at_it():
    d = decoded(stop=["\n\n"])
    d.add([0, 1])
    assert d.text == "ab" and d.delta(final=False) == "a"  # the last character may start "\n\n"
    d.add([2])
    assert d.delta(final=False) == "b" and not d.stopped  # a trailing "\n" is held back
    d.add([2, 3, 4])  # "ab\n\nde": the stop string ends the row, and is not part of its text
    assert d.stopped and d.text == "ab" and d.delta(final=False) == "" and d.delta(final=True) == ""
    d.add([0])  # nothing after the stop
    assert d.ids == [0, 1, 2, 2] and d.text == "ab"  # the ids end with the token completing the stop


def test_decoded_releases_everything_without_a_stop():
    d, parts = decoded(stop=["\n\n", "xyz"]), []
    for chunk in ([0, 2], [1], [23, 24], [3], [2]):  # "a\n", "b", "xy", "d", "\n"
        d.add(chunk)
        parts.append(d.delta(final=False))
    assert parts == ["", "a", "\nb", "x", "y"] and not d.stopped  # two characters always held
    parts.append(d.delta(final=True))
    assert parts[-1] == "d\n"
    assert "".join(parts) == d.text == "a\nbxyd\n"


def test_decoded_stop_string_across_deliveries():
    d = decoded(stop=["xyz"])
    d.add([0, 23])
    assert d.delta(final=False) == ""  # "ax": two characters may begin "xyz"
    d.add([24])
    assert d.delta(final=False) == "a"
    d.add([25, 0])
    assert d.stopped and d.text == "a" and d.delta(final=True) == ""


def test_decoded_earliest_stop_string_wins():
    d = decoded(stop=["\n", "ab"])
    d.add([3, 0, 1, 2, 2])  # "dab\n\n": cut at "ab", the earlier, though listed second
    assert d.stopped and d.text == "d"


def test_decoded_stop_token_ids_end_the_row_with_the_token():
    d = decoded(stop_ids=[4])
    d.add([0, 4, 1])
    assert d.stopped and d.ids == [0, 4] and d.text == "ae" and d.delta(final=False) == "ae"
    d.add([1])
    assert d.ids == [0, 4]


def test_decoded_holds_half_a_character():
    d = decoded()
    d.add([0, 9])
    assert d.text == "a\ufffd" and d.delta(final=False) == "a"
    d.add([10])
    assert d.delta(final=False) == "é" and d.text == "aé"


# ----------------------------------------------------------------------------- everyday: /metrics


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text as {"name{labels}": value}; every sample line must parse, and every
    metric must have its HELP and TYPE."""
    samples, typed = {}, {}
    for line in text.splitlines():
        if line.startswith("# HELP ") or line.startswith("# TYPE "):
            parts = line.split(" ", 3)
            assert len(parts) == 4, line
            if parts[1] == "TYPE":
                typed[parts[2]] = parts[3]
            continue
        m = re.fullmatch(r'([a-z_]+)(\{[a-z_]+="[^"]*"\})? (-?[0-9.e+-]+|\+Inf|NaN)', line)
        assert m, f"unparseable metrics line: {line!r}"
        base = re.sub(r"_(bucket|sum|count)$", "", m[1])
        assert m[1] in typed or typed.get(base) == "histogram", f"{m[1]} has no TYPE"
        samples[m[1] + (m[2] or "")] = float(m[3])
    return samples


def histogram(samples: dict, name: str) -> list[tuple[float, float]]:
    """A histogram's (le, cumulative count) pairs, in order."""
    out = []
    for key, value in samples.items():
        m = re.fullmatch(rf'{name}_bucket\{{le="([^"]+)"\}}', key)
        if m:
            out.append((float(m[1]), value))
    return out


def test_render_metrics_is_prometheus_text_with_cumulative_buckets():
    from dflash_jax.engine.streaming import LATENCY_BUCKETS, EngineMetrics

    m = EngineMetrics(batch_size=4, block_size=4)
    m.running, m.waiting, m.generation_tokens, m.prompt_tokens, m.cached_prompt_tokens = 3, 2, 41, 17, 8
    m.requests["length"] += 2
    m.requests["cancelled"] += 1
    m.cycles, m.accepted = 4, 10
    m.speculation = {0: 0.75, 3: 0.25}
    m.kv_pages = dict(total=10, free=4, cached=3, held=3)
    for a in (1, 3, 3, 4):
        m.acceptance.observe(a)
    for t in (0.004, 0.02, 0.02, 30.0):  # the last beyond every bound: only +Inf counts it
        m.ttft.observe(t)
    text = render_metrics(m)
    assert text.endswith("\n")
    s = parse_metrics(text)
    assert s["dflash_requests_running"] == 3 and s["dflash_requests_waiting"] == 2
    assert s['dflash_requests_finished_total{finish_reason="length"}'] == 2
    assert s['dflash_requests_finished_total{finish_reason="cancelled"}'] == 1
    assert s["dflash_generation_tokens_total"] == 41 and s["dflash_prompt_tokens_total"] == 17
    assert s["dflash_prompt_tokens_cached_total"] == 8 and s["dflash_prefix_cache_hit_rate"] == round(8 / 17, 4)
    assert s["dflash_tau"] == 2.5 and s["dflash_batch_slots"] == 4
    assert s['dflash_speculation_share{draft_tokens="0"}'] == 0.75
    assert s['dflash_speculation_share{draft_tokens="3"}'] == 0.25
    assert [s[f"dflash_kv_pages_{k}"] for k in ("total", "free", "cached", "held")] == [10, 4, 3, 3]
    assert histogram(s, "dflash_acceptance_length") == [(1, 1), (2, 1), (3, 3), (4, 4), (float("inf"), 4)]
    assert s["dflash_acceptance_length_sum"] == 11 and s["dflash_acceptance_length_count"] == 4
    ttft = histogram(s, "dflash_time_to_first_token_seconds")
    assert [b for b, _ in ttft] == [*LATENCY_BUCKETS, float("inf")]
    counts = [n for _, n in ttft]
    assert counts == sorted(counts) and counts[0] == 1 and counts[-2] == 3 and counts[-1] == 4  # cumulative
    assert s["dflash_time_to_first_token_seconds_count"] == 4
    assert s["dflash_time_to_first_token_seconds_sum"] == pytest.approx(30.044)
    assert all(n == 0 for _, n in histogram(s, "dflash_inter_token_latency_seconds"))
    for name in ("dflash_slot_occupancy", "dflash_tokens_per_second"):
        assert name in s
    # Nothing finished yet: the counter is still there, at 0.
    empty = parse_metrics(render_metrics(EngineMetrics(batch_size=2, block_size=16)))
    assert empty['dflash_requests_finished_total{finish_reason="stop"}'] == 0
    assert histogram(empty, "dflash_acceptance_length")[-1] == (float("inf"), 0)


# ----------------------------------------------------------------------------- everyday: the app


class FakeEngine:
    """What create_app uses of a StreamingEngine, without a model: submit() plays a script of
    deliveries (lists of token ids, then a Result with `reason`) on a thread of its own, as the
    engine's thread would; `refuse` is raised by submit instead."""

    def __init__(self, chunks=((1, 3), (4,)), reason="length"):
        from dflash_jax.engine.streaming import EngineMetrics

        self.metrics = EngineMetrics(batch_size=2, block_size=4)
        self.chunks, self.reason, self.refuse, self.alive = [list(c) for c in chunks], reason, None, True
        self.requests, self.closed = [], []

    def check(self, prompt, max_new_tokens):
        return None

    def submit(self, req):
        if self.refuse is not None:
            raise self.refuse
        self.requests.append(req)
        threading.Thread(target=self._play, args=(req,), daemon=True).start()

    def _play(self, req):
        from dflash_jax.engine.slots import Result

        ids = []
        for c in self.chunks:
            ids += c
            if req.sampling.logprobs is None:
                req.emit(list(c), None)
            else:  # scripted logprobs: token t's is -t / 10, its alternatives t + 1, t + 2, ... a tenth below each
                k = req.sampling.logprobs
                req.emit(list(c), None, ([-t / 10 for t in c], [[(t + j, -(t + j) / 10 - 0.1) for j in range(1, k + 1)]
                                                               for t in c]))
        req.emit([], Result(req.row_id, ids if self.reason != "error" else [], [], self.reason))

    def close(self, **kw):
        self.closed.append(kw)
        return True


def app_client(engine, api_key=None):
    from starlette.testclient import TestClient

    from infer.serve.app import create_app

    served = fake_served()
    served.engine, served.context = engine, 64
    return TestClient(create_app(served, api_key))


def events(response) -> list:
    """A server-sent event stream's data, parsed ("[DONE]" kept as is)."""
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    out = []
    for block in response.text.split("\n\n"):
        if block:
            assert block.startswith("data: "), block
            data = block.removeprefix("data: ")
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_a_json_body_is_read_whatever_its_content_type_says():
    """curl's `-d` sends application/x-www-form-urlencoded; the body is JSON all the same."""
    engine = FakeEngine()
    with app_client(engine) as client:
        for content_type in ("application/x-www-form-urlencoded", "text/plain", None):
            headers = {} if content_type is None else {"content-type": content_type}
            r = client.post("/v1/completions", content=b'{"prompt": "xy", "max_tokens": 5}', headers=headers)
            assert r.status_code == 200, (content_type, r.text)
            assert r.json()["choices"][0]["text"] == "bde"
        r = client.post("/v1/completions", content=b"prompt=xy", headers={"content-type": "text/plain"})
        assert r.status_code == 400 and r.json()["error"]["message"] == "the request body is not valid JSON"


def test_app_answers_completions_streamed_and_not():
    engine = FakeEngine()
    with app_client(engine) as client:
        r = client.post("/v1/completions", json={"prompt": "xy", "max_tokens": 5, "return_token_ids": True})
        assert r.status_code == 200
        body = r.json()
        assert body["object"] == "text_completion" and body["model"] == "m" and body["id"].startswith("cmpl-")
        assert body["choices"] == [{"index": 0, "finish_reason": "length", "logprobs": None, "text": "bde",
                                    "token_ids": [1, 3, 4]}]
        assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
        req = engine.requests[-1]
        assert req.prompt == [120, 121] and req.max_new_tokens == 5

        got = events(client.post("/v1/completions", json={"prompt": "xy", "stream": True, "return_token_ids": True,
                                                          "stream_options": {"include_usage": True}}))
        assert got[-1] == "[DONE]" and got[-2]["choices"] == [] and got[-2]["usage"]["completion_tokens"] == 3
        chunks = got[:-2]
        assert "".join(c["choices"][0]["text"] for c in chunks) == "bde"
        assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == [1, 3, 4]
        assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
        assert all(c["usage"] is None and c["id"] == got[-2]["id"] for c in chunks)

        got = events(client.post("/v1/chat/completions", json={"messages": CHAT, "stream": True}))
        assert got[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""} and got[-1] == "[DONE]"
        assert all(c["object"] == "chat.completion.chunk" and "token_ids" not in c["choices"][0] for c in got[:-1])
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in got[:-1]) == "bde"
        r = client.post("/v1/chat/completions", json={"messages": CHAT})
        assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": "bde"}

        assert client.get("/health").json() == {"status": "ok"}
        models = client.get("/v1/models").json()
        assert [m["id"] for m in models["data"]] == ["m"] and models["data"][0]["max_model_len"] == 64
        r = client.get("/metrics")
        assert r.status_code == 200 and "dflash_requests_running 0" in r.text
    assert engine.closed == [{"cancel_running": True, "timeout": 30}]  # shutting down cancels what still runs


def test_app_answers_logprobs_in_both_shapes_whole_and_streamed():
    """The scripted engine's logprobs (token t: -t/10; alternatives t+1.. a tenth below each) reach
    the client: chat's `content` entries (token, logprob, bytes, top_logprobs), completions' four
    lists (text_offset counting the tokens' characters), whole and per chunk; a stop string's cut
    cuts them too; a request that asks for none has null."""
    engine = FakeEngine()  # tokens 1, 3 then 4: "b", "d", "e"
    entry = lambda t: {"token": decode([t]), "logprob": -t / 10, "bytes": list(decode([t]).encode())}  # 2: "\n"
    with app_client(engine) as client:
        r = client.post("/v1/chat/completions", json={"messages": CHAT, "logprobs": True, "top_logprobs": 2})
        assert r.status_code == 200, r.text
        assert engine.requests[-1].sampling.logprobs == 2
        content = r.json()["choices"][0]["logprobs"]["content"]
        assert [c["token"] for c in content] == ["b", "d", "e"]
        for c, t in zip(content, (1, 3, 4)):
            assert {k: c[k] for k in ("token", "logprob", "bytes")} == entry(t)
            assert c["top_logprobs"] == [{**entry(t + j), "logprob": pytest.approx(-(t + j) / 10 - 0.1)}
                                         for j in (1, 2)]
        r = client.post("/v1/chat/completions", json={"messages": CHAT, "logprobs": True})
        assert all(c["top_logprobs"] == [] for c in r.json()["choices"][0]["logprobs"]["content"])
        assert engine.requests[-1].sampling.logprobs == 0
        assert client.post("/v1/chat/completions", json={"messages": CHAT}).json()["choices"][0]["logprobs"] is None

        got = events(client.post("/v1/chat/completions", json={"messages": CHAT, "logprobs": True, "top_logprobs": 1,
                                                               "stream": True}))
        streamed = [c["choices"][0]["logprobs"] for c in got[1:-1]]
        assert [[e["token"] for e in lp["content"]] for lp in streamed if lp] == [["b", "d"], ["e"]]
        assert [e["top_logprobs"][0]["token"] for lp in streamed if lp for e in lp["content"]] == ["\n", "e", "f"]

        r = client.post("/v1/completions", json={"prompt": "xy", "logprobs": 2})
        lp = r.json()["choices"][0]["logprobs"]
        assert lp["tokens"] == ["b", "d", "e"] and lp["token_logprobs"] == [-0.1, -0.3, -0.4]
        assert lp["text_offset"] == [0, 1, 2]
        assert lp["top_logprobs"] == [{"\n": pytest.approx(-0.3), "d": pytest.approx(-0.4)},
                                      {"e": pytest.approx(-0.5), "f": pytest.approx(-0.6)},
                                      {"f": pytest.approx(-0.6), "g": pytest.approx(-0.7)}]
        assert client.post("/v1/completions", json={"prompt": "xy", "logprobs": 0}).json()["choices"][0][
            "logprobs"]["top_logprobs"] == [None, None, None]
        got = events(client.post("/v1/completions", json={"prompt": "xy", "logprobs": 1, "stream": True}))
        streamed = [c["choices"][0]["logprobs"] for c in got[:-1]]
        assert [(x["tokens"], x["text_offset"]) for x in streamed if x] == [(["b", "d"], [0, 1]), (["e"], [2])]

        # "d" completes the stop string: the answer, its tokens and their logprobs end there
        r = client.post("/v1/completions", json={"prompt": "xy", "logprobs": 0, "stop": "d"})
        assert r.json()["choices"][0]["text"] == "b" and r.json()["choices"][0]["logprobs"]["tokens"] == ["b", "d"]


def test_a_tokens_bytes_are_its_own_where_it_is_half_a_character():
    from infer.serve.logprobs import token_piece

    pieces = {1: "Ã", 2: "<0xE2>", 3: "Ġhi"}  # byte-level BPE's 0xC3, SentencePiece's byte token, " hi"
    tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens: " hi" if ids == [3] else "\ufffd",
                                convert_ids_to_tokens=pieces.get)
    assert token_piece(tokenizer, 1) == ("\ufffd", [0xC3])
    assert token_piece(tokenizer, 2) == ("\ufffd", [0xE2])
    assert token_piece(tokenizer, 3) == (" hi", [32, 104, 105])
    assert token_piece(None, 7) == ("token_id:7", list(b"token_id:7"))


def test_app_stop_string_cuts_the_answer_and_cancels_the_row():
    engine = FakeEngine(chunks=([0, 2], [2, 3], [4]))  # "a\n", "\nd", "e"
    with app_client(engine) as client:
        r = client.post("/v1/completions", json={"prompt": "x", "stop": "\n\n", "return_token_ids": True})
        choice = r.json()["choices"][0]
        assert choice["text"] == "a" and choice["finish_reason"] == "stop"
        assert engine.requests[-1].cancelled  # the row ends at the engine's next sync
        got = events(client.post("/v1/completions", json={"prompt": "x", "stop": ["\n\n"], "stream": True}))
        assert got[-1] == "[DONE]" and "".join(c["choices"][0]["text"] for c in got[:-1]) == "a"
        assert got[-2]["choices"][0]["finish_reason"] == "stop" and engine.requests[-1].cancelled
        # A request's own stop token ends it with the token.
        r = client.post("/v1/completions", json={"prompt": "x", "stop_token_ids": [3], "return_token_ids": True})
        choice = r.json()["choices"][0]
        assert choice["token_ids"] == [0, 2, 2, 3] and choice["text"] == "a\n\nd" and choice["finish_reason"] == "stop"


def test_n_choices_are_rows_of_their_own_streamed_and_not():
    """n = 3: three engine rows of the prompt, choice 0 keyed by the seed (the n = 1 request's row),
    the others by streams derived from it; the answer has a choice per row, in order, and usage
    counts the prompt once; a stream tags each chunk with its choice, each ending once."""
    engine = FakeEngine()
    with app_client(engine) as client:
        r = client.post("/v1/completions", json={"prompt": "xy", "n": 3, "seed": 5, "temperature": 1.0,
                                                 "return_token_ids": True})
        body = r.json()
        assert [c["index"] for c in body["choices"]] == [0, 1, 2]
        assert all(c["text"] == "bde" and c["finish_reason"] == "length" for c in body["choices"])
        assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 9, "total_tokens": 11}
        rows = [q.row_id for q in engine.requests[-3:]]
        assert rows[0] == 5 and len(set(rows)) == 3
        assert all(q.prompt == [120, 121] for q in engine.requests[-3:])
        client.post("/v1/completions", json={"prompt": "xy", "n": 3, "seed": 5, "temperature": 1.0})
        assert [q.row_id for q in engine.requests[-3:]] == rows  # the same seed, the same streams

        got = events(client.post("/v1/chat/completions", json={"messages": CHAT, "n": 2, "stream": True,
                                                               "stream_options": {"include_usage": True}}))
        assert got[-1] == "[DONE]" and got[-2]["usage"]["completion_tokens"] == 6
        chunks = [c["choices"][0] for c in got[:-2]]
        for i in (0, 1):
            mine = [c for c in chunks if c["index"] == i]
            assert mine[0]["delta"] == {"role": "assistant", "content": ""}
            assert "".join(c["delta"].get("content", "") for c in mine) == "bde"
            assert [c["finish_reason"] for c in mine] == [None] * (len(mine) - 1) + ["length"]


def test_a_refused_choice_cancels_the_ones_queued():
    """The queue fills after the first of n = 2 rows: 429, and the row queued is cancelled."""
    from dflash_jax.engine.streaming import QueueFull

    engine = FakeEngine()
    submit = engine.submit

    def second_refused(req):
        if len(engine.requests) == 1:
            raise QueueFull("the queue is full")
        submit(req)

    engine.submit = second_refused
    with app_client(engine) as client:
        r = client.post("/v1/completions", json={"prompt": "x", "n": 2})
        assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
        assert len(engine.requests) == 1 and engine.requests[0].cancelled


def test_app_errors():
    from dflash_jax.engine.streaming import Closed, QueueFull

    engine = FakeEngine()
    with app_client(engine, api_key="k") as client:
        for r in (client.post("/v1/completions", json={"prompt": "x"}),
                  client.get("/v1/models", headers={"Authorization": "Bearer nope"})):
            assert r.status_code == 401
            assert r.json()["error"]["type"] == "authentication_error" and r.json()["error"]["code"] == "invalid_api_key"
        key = {"Authorization": "Bearer k"}
        assert client.get("/v1/models", headers=key).status_code == 200
        assert client.get("/health").status_code == 200  # no key needed
        assert client.get("/metrics").status_code == 401 and client.get("/metrics", headers=key).status_code == 200

        r = client.post("/v1/completions", content=b"{nope", headers=key)
        assert r.status_code == 400 and r.json()["error"]["message"] == "the request body is not valid JSON"
        engine.refuse = QueueFull("80 requests are waiting, the most this server queues")
        r = client.post("/v1/completions", json={"prompt": "x"}, headers=key)
        assert r.status_code == 429
        assert r.json()["error"]["type"] == "rate_limit_error" and r.json()["error"]["code"] == "queue_full"
        engine.refuse = Closed("the server is shutting down")
        r = client.post("/v1/chat/completions", json={"messages": CHAT, "stream": True}, headers=key)
        assert r.status_code == 503 and r.json()["error"]["code"] == "unavailable"
        engine.refuse = None

        engine.reason = "error"  # the engine failed under the request
        r = client.post("/v1/completions", json={"prompt": "x"}, headers=key)
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        got = events(client.post("/v1/completions", json={"prompt": "x", "stream": True}, headers=key))
        assert got[-1] != "[DONE]" and got[-1]["error"]["type"] == "server_error"
        engine.alive = False
        assert client.get("/health").status_code == 503


@heavy
def test_schemathesis_finds_no_5xx_and_every_4xx_in_openai_schema():
    """schemathesis against the app's own OpenAPI schema, in process (ASGI, no socket) over the
    scripted fake engine: requests that fit the schema and requests that do not, a bounded
    number per operation (25 a mode; the everyday fuzz of test_serve_input.py sends a thousand
    more). No answer is a 5xx, and every 4xx carries OpenAI's error body."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings
    from schemathesis import GenerationMode

    from infer.serve.app import create_app

    served = fake_served()
    served.engine, served.context = FakeEngine(), 64
    schema = schemathesis.openapi.from_asgi("/openapi.json", create_app(served))
    seen: dict[int, int] = {}

    def check(case):
        r = case.call()
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        where = f"{case.method} {case.path} {case.body!r}"
        assert r.status_code < 500, f"{r.status_code} for {where}: {r.text[:500]}"
        if r.status_code >= 400:
            err = r.json()["error"]
            assert list(err) == ["message", "type", "param", "code"] and err["message"], (where, r.text)
            assert isinstance(err["type"], str) and (err["param"] is None or isinstance(err["param"], str)), where

    operations = [result.ok() for result in schema.get_all_operations()]
    assert {f"{op.method.upper()} {op.path}" for op in operations} >= {
        "POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models", "GET /health", "GET /metrics"}
    for op in operations:
        # Requests that do not fit the schema only where there is something to break (a body).
        modes = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) if op.method.upper() == "POST" else \
            (GenerationMode.POSITIVE,)
        for mode in modes:
            runs = settings(max_examples=25, deadline=None, database=None, derandomize=True,
                            suppress_health_check=list(HealthCheck))(given(case=op.as_strategy(mode))(check))
            runs()
    assert seen.get(200) and seen.get(400), seen  # both kinds were exercised
    print(f"schemathesis: {sum(seen.values())} requests, by status {dict(sorted(seen.items()))}")


def test_while_warming_up_health_and_requests_answer_503():
    """Before the engine has loaded and compiled: /health 503 "warming up" with what it is doing,
    completions 503 "warming_up", /metrics dflash_ready 0; once ready, 200 and dflash_ready 1."""
    from starlette.testclient import TestClient

    from infer.serve.app import create_app

    served = fake_served()
    served.engine, served.context, served.state, served.detail = None, 64, "compiling", "compiling 3/26: cancel"
    with TestClient(create_app(served)) as client:
        r = client.get("/health")
        assert r.status_code == 503 and r.json() == {"status": "warming up", "detail": "compiling 3/26: cancel"}
        r = client.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "warming_up"
        assert "compiling 3/26" in r.json()["error"]["message"]
        assert client.get("/v1/models").status_code == 200  # the name is known before the weights load
        assert "dflash_ready 0" in client.get("/metrics").text
        served.state = "failed"
        assert client.get("/health").json()["status"] == "failed"
        served.engine, served.state = FakeEngine(), "ready"
        assert client.get("/health").status_code == 200 and "dflash_ready 1" in client.get("/metrics").text
        assert client.post("/v1/completions", json={"prompt": "x"}).status_code == 200


def test_the_server_prefills_at_two_widths_and_splits_small_groups():
    """The server compiles prefill at widths 1 and the batch only (half the programs of every
    power of two): a group of requests is padded to the batch unless that more than doubles it,
    then prefilled one by one; with every width, a group is padded to the next power of two."""
    from dflash_jax.engine.scheduler import admission_parts

    two = [1, 8]
    parts = lambda n, widths=two: admission_parts(widths, list(range(n)))
    assert parts(1) == [[0]] and parts(3) == [[0], [1], [2]] and parts(4) == [[0, 1, 2, 3]]
    assert parts(5) == [list(range(5))] and parts(8) == [list(range(8))]
    every = [1, 2, 4, 8]
    assert all(parts(n, every) == [list(range(n))] for n in range(1, 9))


def test_the_server_pages_the_kv_cache_and_caches_prefixes_by_default():
    """With no --kv-pages the server's engine options hold a page pool of per-row caches' memory
    (`infer.serve.model.default_pool`) and prefix caching on where the target allows it (the demo's
    dense target does); --kv-pages 0 keeps per-row caches, --kv-pages N sizes the pool. Read from
    the flags and the configs: nothing loads or compiles."""
    from dflash_jax.engine.scheduler import per_row_pages
    from dflash_jax.errors import DFlashError
    from infer.serve.__main__ import build_parser
    from infer.serve.model import ServedModel

    def served(*flags):
        return ServedModel(build_parser().parse_args(list(flags)), say=lambda *a: None)

    model = served()
    o = model.options
    assert model.kv_default and o.prefix_cache is None  # None: on, wherever it can work
    assert o.kv_pages == per_row_pages(o.batch_size, model.max_prompt, model.max_new, 16, 0, o.page_size) > 0
    tree = served("--tree-budget", "32", "--batch-size", "4").options
    assert tree.kv_pages == per_row_pages(4, model.max_prompt, model.max_new, 16, 32, o.page_size)
    assert served("--block-size", "1").options.kv_pages == per_row_pages(8, model.max_prompt, model.max_new, 1)
    assert served("--kv-pages", "0").options.kv_pages is None  # per-row caches
    assert served("--kv-pages", "40").options.kv_pages == 40
    assert served("--prefix-cache", "on").options.prefix_cache == "on"  # the default pool is there to share
    assert served("--prefix-cache", "off").options.prefix_cache == "off"
    with pytest.raises(DFlashError, match=r"--kv-pages must be >= 0 \(0: per-row caches\), got -1"):
        served("--kv-pages", "-1")
    with pytest.raises(DFlashError, match=r"--prefix-cache on needs a page pool"):
        served("--kv-pages", "0", "--prefix-cache", "on")


def test_a_stop_string_ends_a_request_as_stop_in_the_metrics():
    """A request its caller stopped (a stop string) is counted under finish_reason "stop", one a
    client abandoned under "cancelled"."""
    from dflash_jax.engine.streaming import StreamRequest, _cancel_reason

    assert _cancel_reason(StreamRequest([1], 1, lambda *a: None, stopped=True, cancelled=True)) == "stop"
    assert _cancel_reason(StreamRequest([1], 1, lambda *a: None, cancelled=True)) == "cancelled"


def test_a_failing_engine_answers_its_open_requests_and_says_so():
    """The engine's thread fails (here: allocating its state): every open request ends with
    "error", on_error hears of it (the server then shuts down, exit status 3), and new requests are
    refused naming the failure."""
    from dflash_jax.engine import Sampling
    from dflash_jax.engine.streaming import StreamRequest, StreamingEngine
    from dflash_jax.errors import DFlashError

    spec = SimpleNamespace(sampling=Sampling(per_row=True), max_new_tokens=8, block_size=4, kv_pages=None,
                           prefill_chunk=16, target=SimpleNamespace(num_linear_layers=0), uses_drafter=True)
    release = threading.Event()

    def new_state():
        release.wait(10)
        raise RuntimeError("device lost")

    gen = SimpleNamespace(spec=spec, tail_widths=[], batch_size=2, max_prompt_len=16, new_state=new_state,
                          check_prompt=lambda prompt, n: None)
    errors, results = [], []
    engine = StreamingEngine(gen, on_error=errors.append).start()
    engine.submit(StreamRequest([1, 2], 4, lambda tokens, result: results.append(result), row_id=1))
    release.set()
    engine._thread.join(10)
    assert not engine.alive and [r.finish_reason for r in results] == ["error"]
    assert len(errors) == 1 and str(errors[0]) == "device lost"
    with pytest.raises(DFlashError, match="the engine failed: device lost"):
        engine.submit(StreamRequest([1], 4, lambda tokens, result: None))


# ----------------------------------------------------------------------------- everyday: tool calls

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}, "days": {"type": "integer"}}}}}
HERMES_ANSWER = ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
                 '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')


def tool_client(answer: str, pieces: int = 7, reason: str = "stop"):
    """The app over a scripted engine whose tokens are characters (a token's id is its code point):
    it answers `answer` in `pieces` deliveries. Its decode drops the hermes markers as a tokenizer
    skips special tokens, unless asked to keep the format's markers."""
    from starlette.testclient import TestClient

    from infer.serve.app import create_app

    ids = [ord(c) for c in answer]
    step = -(-len(ids) // pieces)
    engine = FakeEngine(chunks=[ids[i:i + step] for i in range(0, len(ids), step)], reason=reason)
    served = fake_served()
    def decode(ids, keep_markers=False):
        text = "".join(map(chr, ids))
        return text if keep_markers else text.replace("<tool_call>", "").replace("</tool_call>", "")

    served.decode = decode
    served.vocab_size, served.engine, served.context = 0x110000, engine, 64
    return TestClient(create_app(served, None)), served


def test_a_chat_with_tools_answers_the_calls_whole_and_streamed():
    client, served = tool_client(HERMES_ANSWER)
    body = {"messages": CHAT, "tools": [WEATHER]}  # tool_choice "auto": the default with tools
    with client:
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Checking."
        calls = choice["message"]["tool_calls"]
        assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
            ("function", "get_weather", {"city": "Paris", "days": 3}), ("function", "get_weather", {"city": "Rome"})]
        assert all(c["id"].startswith("call_") for c in calls) and calls[0]["id"] != calls[1]["id"]
        messages, kwargs = served.chats[-1]
        assert kwargs["tools"] == [WEATHER]  # the tools reach the template

        got = events(client.post("/v1/chat/completions", json={**body, "stream": True}))
        assert got[-1] == "[DONE]" and got[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        deltas = [c["choices"][0]["delta"] for c in got[1:-1]]
        assert "".join(d.get("content") or "" for d in deltas) == "Checking."
        streamed = {}
        for d in deltas:
            for c in d.get("tool_calls", ()):
                entry = streamed.setdefault(c["index"], {"name": c["function"].get("name"), "arguments": ""})
                assert ("id" in c) == (entry["arguments"] == "" and "name" in c["function"])  # the id comes first
                entry["arguments"] += c["function"]["arguments"]
        assert [(e["name"], json.loads(e["arguments"])) for _, e in sorted(streamed.items())] == [
            ("get_weather", {"city": "Paris", "days": 3}), ("get_weather", {"city": "Rome"})]
        reasons = [c["choices"][0]["finish_reason"] for c in got[1:-1]]
        assert reasons == [None] * (len(reasons) - 1) + ["tool_calls"]

        # parallel_tool_calls false: the first call only, whole and streamed.
        r = client.post("/v1/chat/completions", json={**body, "parallel_tool_calls": False})
        assert [c["function"]["arguments"] for c in r.json()["choices"][0]["message"]["tool_calls"]] == [
            '{"city": "Paris", "days": 3}']
        got = events(client.post("/v1/chat/completions", json={**body, "parallel_tool_calls": False, "stream": True}))
        assert {c["index"] for x in got[1:-1] for c in x["choices"][0]["delta"].get("tool_calls", ())} == {0}

        # tool_choice "none": the tools are in the template, the answer is text (special tokens skipped, as always).
        r = client.post("/v1/chat/completions", json={**body, "tool_choice": "none"})
        choice = r.json()["choices"][0]
        assert choice["message"] == {"role": "assistant", "content": HERMES_ANSWER.replace("<tool_call>", "").replace(
            "</tool_call>", "")} and choice["finish_reason"] == "stop"
        assert served.chats[-1][1]["tools"] == [WEATHER]


def test_a_chat_with_tools_and_no_call_answers_text():
    client, _ = tool_client("Paris is sunny. <tool_use> is not a call.\n")
    with client:
        r = client.post("/v1/chat/completions", json={"messages": CHAT, "tools": [WEATHER]})
        choice = r.json()["choices"][0]
        assert choice == {"index": 0, "finish_reason": "stop", "logprobs": None,
                          "message": {"role": "assistant", "content": "Paris is sunny. <tool_use> is not a call.\n"}}
        got = events(client.post("/v1/chat/completions", json={"messages": CHAT, "tools": [WEATHER], "stream": True}))
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in got[:-1]) == choice["message"]["content"]
        assert got[-2]["choices"][0]["finish_reason"] == "stop"


def test_tool_and_assistant_call_messages_reach_the_template():
    served = fake_served()
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                    {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
                {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "rain"}]}]
    prepare_request(served, {"messages": messages, "tools": [WEATHER]}, True)
    sent, kwargs = served.chats[-1]
    assert sent[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]}
    assert sent[2:] == [{"role": "tool", "content": "sunny", "tool_call_id": "c1", "name": "get_weather"},
                        {"role": "tool", "content": "rain", "tool_call_id": "c2", "name": "get_weather"}]
    prepare_request(served, {"messages": messages}, True)  # a conversation with calls needs no tools now
    assert "tools" not in served.chats[-1][1]


def _tool_refusal(body, served=None) -> APIError:
    with pytest.raises(APIError) as e:
        prepare_request(served or fake_served(), {"messages": CHAT, **body}, True)
    assert e.value.status == 400 and len(e.value.message) < 300
    return e.value


@pytest.mark.parametrize("body,param,says", [
    ({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools", "tools[0].function.name must be"),
    ({"tools": [{"type": "function", "function": {"name": "f" * 65}}]}, "tools", "function.name must be 1 to 64"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "strnig"}}}}}]}, "tools", "tools[0].function.parameters is not a valid JSON schema"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]}, "tools",
     "a JSON schema of an object"),
    ({"tools": [{"type": "function", "function": {"name": "f", "params": {}}}]}, "tools", "unknown field 'params'"),
    ({"tools": [{"type": "retrieval"}]}, "tools", "tools[0] must be"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "another tool's too"),
    ({"tools": [WEATHER] * 129}, "tools", "at most 128"),
    ({"tools": "get_weather"}, "tools", "tools must be a list"),
    ({"tools": [WEATHER], "tool_choice": "required"}, "tool_choice", "tool_choice: structured output is off on this server"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice",
     "structured output is off on this server"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice",
     "not among tools"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice", "tool_choice must be"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER], "parallel_tool_calls": "no"}, "parallel_tool_calls", "must be a boolean"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "[1]"}}]}]},
     "messages[0]", "arguments must be a JSON object"),
    ({"messages": [{"role": "user", "tool_calls": [{"id": "c", "function": {"name": "f"}}]}]}, "messages[0]",
     "only an assistant message has tool_calls"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f"}}]},
                   {"role": "tool", "content": "x"}]}, "messages[1]", "needs the tool_call_id"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f"}},
                                                        {"id": "c", "function": {"name": "g"}}]}]},
     "messages[0]", "an earlier call's too"),
])
def test_tool_requests_are_checked(body, param, says):
    e = _tool_refusal(body)
    assert e.param == param and says in e.message, e.message


def test_tools_are_refused_where_the_chat_template_takes_none():
    from infer.serve.toolcalls.request import ModelTools

    served = fake_served()
    served.tools = ModelTools.of("llama", "{{ messages[0].content }}")  # never reads `tools`: they would vanish
    e = _tool_refusal({"tools": [WEATHER]}, served)
    assert e.param == "tools" and "takes no tools" in e.message
    assert served.tools.format.name == "llama3" and served.chats == []


# ----------------------------------------------------------------------------- heavy: the server

# (id, prompt or token ids, max_tokens): greedy, the same from the server as from `python -m infer`.
# Two stop early on an end-of-text token (after 8 tokens and at once); one is token ids.
PROMPTS = [
    ("p0", "def fibonacci(n):\n", 60),
    ("p1", 'if __name__ == "__main__":\n    unittest', 60),
    ("p2", "class Stack:\n", 5),
    ("p3", "import os\n", 33),
    ("p4", "def add(a, b):\n    return a + b\n", 47),
    ("p5", 'if __name__ == "__main__":\n    sys.exit(main())\n', 20),
    ("p6", [760, 667, 202, 760, 708, 202], 12),  # "import os\nimport sys\n" as token ids
    ("p7", '"""Utilities."""\n', 27),
]
# Prompts the demo model never ends early (greedy, 128 tokens): their rows run until cancelled.
LONG_PROMPTS = ["def fibonacci(n):\n", "import os\n", "class Stack:\n", "def test():\n    assert"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tail(path: Path, n: int = 4000) -> str:
    return path.read_text(errors="replace")[-n:] if path.is_file() else "(no output)"


@pytest.fixture(scope="module")
def offline_run(tmp_path_factory):
    """`python -m infer` on PROMPTS, started at once so that it runs while the server compiles (both
    with `--speculation fixed`, as the server: see `server`)."""
    d = tmp_path_factory.mktemp("offline")
    rows = [{"id": i, ("input_ids" if isinstance(p, list) else "prompt"): p, "max_new_tokens": n} for i, p, n in PROMPTS]
    (d / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    err = d / "stderr.txt"
    with open(err, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "infer", "--input", str(d / "in.jsonl"), "--output",
                                 str(d / "out.jsonl"), "--max-new-tokens", "128", "--batch-size", "4", "--quiet",
                                 "--speculation", "fixed"],
                                cwd=REPO, stdout=subprocess.DEVNULL, stderr=f)
    yield proc, d / "out.jsonl", err
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def offline(offline_run):
    """{id: the offline record} for PROMPTS."""
    proc, out, err = offline_run
    try:
        code = proc.wait(timeout=300)
    except subprocess.TimeoutExpired:
        pytest.fail(f"python -m infer did not finish in 300 s:\n{tail(err)}")
    assert code == 0, f"python -m infer exited {code}:\n{tail(err)}"
    records = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert sorted(records) == sorted(i for i, _, _ in PROMPTS)
    return records


class Server:
    def __init__(self, proc: subprocess.Popen, port: int, log: Path):
        self.proc, self.port, self.log = proc, port, log
        self.url = f"http://127.0.0.1:{port}"

    def client(self, **kw):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key="x", max_retries=0, timeout=kw.pop("timeout", TIMEOUT), **kw)

    def async_client(self, **kw):
        import openai

        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="x", max_retries=0,
                                  timeout=kw.pop("timeout", TIMEOUT), **kw)

    def metrics(self) -> dict[str, float]:
        import httpx

        r = httpx.get(self.url + "/metrics", timeout=TIMEOUT)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        return parse_metrics(r.text)

    def wait_idle(self, timeout: float = 60) -> dict[str, float]:
        """Poll /metrics until no request runs or waits; returns the last figures."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if m["dflash_requests_running"] == 0 and m["dflash_requests_waiting"] == 0:
                return m
            assert time.monotonic() < deadline, f"still busy after {timeout} s: running " \
                f"{m['dflash_requests_running']}, waiting {m['dflash_requests_waiting']}"
            time.sleep(0.2)

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail(f"the server did not exit within {timeout} s of SIGTERM:\n{tail(self.log)}")


@pytest.fixture(scope="module")
def server(offline_run, tmp_path_factory):
    """The demo pair served on a free port; SIGTERM at the end must end it with exit status 0.
    `--speculation fixed`: every cycle drafts, so these tests serve DFlash cycles throughout (auto
    would run plain decoding on a CPU, where it wins); auto is served in tests/test_soak.py."""
    pytest.importorskip("openai")
    log = tmp_path_factory.mktemp("server") / "stderr.txt"
    port = free_port()
    with open(log, "wb") as f:
        # --trust-request-chat-template: the demo's own template takes no tools; the tools test brings one
        proc = subprocess.Popen([sys.executable, "-m", "infer.serve", "--max-prompt-len", "64", "--batch-size", "4",
                                 "--port", str(port), "--max-waiting", "80", "--speculation", "fixed",
                                 "--trust-request-chat-template"],
                                cwd=REPO, stdout=subprocess.DEVNULL, stderr=f)
    srv = Server(proc, port, log)
    deadline = time.monotonic() + START_TIMEOUT
    import httpx

    srv.warming = []  # what /health answered before the engine was ready
    ready = False
    try:
        while "serving " not in (log.read_text(errors="replace") if log.is_file() else ""):
            if proc.poll() is not None:
                pytest.fail(f"the server exited with status {proc.returncode} before serving:\n{tail(log)}")
            if time.monotonic() > deadline:
                pytest.fail(f"the server was not serving after {START_TIMEOUT} s:\n{tail(log)}")
            with contextlib.suppress(httpx.TransportError):
                r = httpx.get(srv.url + "/health", timeout=5)
                if r.status_code == 200:  # ready: the "serving" line follows the state by a moment
                    ready = True
                if not ready:
                    srv.warming.append((r.status_code, r.json()))
            time.sleep(0.5)

        while True:  # the line comes just before uvicorn binds
            try:
                if httpx.get(srv.url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                pytest.fail(f"/health never answered 200:\n{tail(log)}")
            time.sleep(0.2)
    except BaseException:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        raise
    yield srv
    code = srv.stop()
    assert code == 0, f"the server exited {code} on SIGTERM:\n{tail(srv.log)}"


def run_async(make, timeout: float):
    """Run the coroutine make() returns, failing after timeout seconds."""
    async def bounded():
        return await asyncio.wait_for(make(), timeout)

    return asyncio.run(bounded())


async def complete(client, prompt, max_tokens, stream: bool, **kw) -> dict:
    """One completion: its text, token ids, finish reason and usage, however it came."""
    extra = {"return_token_ids": True, **kw.pop("extra_body", {})}
    if not stream:
        r = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                            extra_body=extra, **kw)
        c = r.choices[0]
        return {"id": r.id, "text": c.text, "ids": c.token_ids, "finish": c.finish_reason, "usage": r.usage,
                "chunks": 1}
    s = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, stream=True,
                                        stream_options={"include_usage": True}, extra_body=extra, **kw)
    out = {"id": None, "text": "", "ids": [], "finish": None, "usage": None, "chunks": 0}
    async with s:
        async for chunk in s:
            out["id"] = out["id"] or chunk.id
            assert chunk.id == out["id"]  # one stream, one id
            if chunk.usage is not None:
                out["usage"] = chunk.usage
            if not chunk.choices:
                continue
            c = chunk.choices[0]
            assert out["finish"] is None, "a chunk after the one with the finish reason"
            out["text"] += c.text
            out["ids"] += c.token_ids
            out["finish"] = c.finish_reason
            out["chunks"] += 1
    return out


def check_usage(r: dict, prompt_tokens: int | None = None):
    assert r["usage"] is not None
    assert r["usage"].completion_tokens == len(r["ids"])
    assert r["usage"].total_tokens == r["usage"].prompt_tokens + r["usage"].completion_tokens
    if prompt_tokens is not None:
        assert r["usage"].prompt_tokens == prompt_tokens


def one_request(server, prompt, max_tokens, **kw) -> dict:
    return run_async(lambda: _alone(server, prompt, max_tokens, **kw), TIMEOUT)


async def _alone(server, prompt, max_tokens, **kw):
    async with server.async_client() as client:
        return await complete(client, prompt, max_tokens, stream=False, **{"temperature": 0, **kw})


@heavy
def test_the_port_opens_before_the_engine_is_ready_and_health_says_so(server):
    """The server answers while it loads and compiles: /health 503 "warming up" with what it is
    doing, then 200 once it serves; its log shows each compile step and how many programs the
    persistent cache held."""
    assert server.warming, "/health never answered before the server was ready"
    codes = {code for code, _ in server.warming}
    assert codes == {503}, server.warming
    assert all(body["status"] == "warming up" and body["detail"] for _, body in server.warming), server.warming
    log = server.log.read_text(errors="replace")
    assert log.index("listening on ") < log.index("serving ")
    assert re.search(r"compiling 1/\d+: prompts of 16 tokens x 1", log) and re.search(
        r"compiled in [\d.]+s: \d+ programs, \d+ loaded from the cache", log), log


@heavy
def test_concurrent_streams_equal_offline_generation(server, offline):
    """8 greedy streams at once on 4 slots (half of them queue), each with its own max_tokens,
    then the same 8 not streamed, at once: token ids, text and finish reason equal
    `python -m infer`'s; both finish reasons occur."""
    assert {r["finish_reason"] for r in offline.values()} == {"stop", "length"}
    before = server.metrics()

    async def go(stream):
        async with server.async_client() as client:
            return await asyncio.gather(*[complete(client, p, n, stream=stream, temperature=0) for _, p, n in PROMPTS])

    for stream in (True, False):
        results = run_async(lambda stream=stream: go(stream), 180)
        for (i, p, n), r in zip(PROMPTS, results):
            ref = offline[i]
            assert r["ids"] == ref["output_ids"], (i, stream)
            assert r["text"] == ref["text"], (i, stream)
            assert r["finish"] == ref["finish_reason"], (i, stream)
            assert len(r["ids"]) == n if r["finish"] == "length" else 1 <= len(r["ids"]) <= n
            check_usage(r, len(p) if isinstance(p, list) else None)
            if stream and len(r["ids"]) > 12:
                assert r["chunks"] > 2, f"{i}: {len(r['ids'])} tokens came in {r['chunks']} chunks"
    assert len({r["id"] for r in results}) == len(PROMPTS)
    after = server.wait_idle()
    done = lambda m: sum(v for k, v in m.items() if k.startswith("dflash_requests_finished_total"))
    assert done(after) - done(before) == 2 * len(PROMPTS)
    tokens = 2 * sum(len(r["output_ids"]) for r in offline.values())
    assert after["dflash_generation_tokens_total"] - before["dflash_generation_tokens_total"] == tokens
    assert after["dflash_tau"] > 1.0  # the drafter's tokens are accepted
    assert after["dflash_acceptance_length_count"] > before["dflash_acceptance_length_count"]
    assert after["dflash_time_to_first_token_seconds_count"] >= before["dflash_time_to_first_token_seconds_count"] + 16


SAMPLED = dict(temperature=0.9, top_p=0.95, seed=1234, extra_body={"top_k": 40})


@heavy
def test_seeded_sampling_is_reproducible_alone_and_among_others(server):
    """A seeded sampled request gives the same tokens alone and among 6 others (greedy and
    sampled with other seeds, streamed and not); another seed gives other tokens."""
    prompt = "class Stack:\n"
    alone = one_request(server, prompt, 24, **SAMPLED)
    assert len(alone["ids"]) == 24 and alone["finish"] == "length"

    async def crowd():
        async with server.async_client() as client:
            jobs = [complete(client, prompt, 24, stream=True, **SAMPLED),
                    complete(client, "def fibonacci(n):\n", 40, stream=False, temperature=0),
                    complete(client, prompt, 24, stream=True, temperature=0),
                    complete(client, prompt, 24, stream=False, temperature=0.9, top_p=0.95, seed=7,
                             extra_body={"top_k": 40}),
                    complete(client, "import os\n", 20, stream=True, temperature=1.0, seed=99),
                    complete(client, prompt, 24, stream=False, **SAMPLED),
                    complete(client, "def test():\n    assert", 20, stream=False, temperature=0.7, seed=5)]
            return await asyncio.gather(*jobs)

    results = run_async(crowd, 180)
    assert results[0]["ids"] == alone["ids"] and results[0]["text"] == alone["text"]  # streamed, among others
    assert results[5]["ids"] == alone["ids"]  # twice at once
    assert results[3]["ids"] != alone["ids"]  # seed 7
    assert results[2]["ids"] != alone["ids"]  # greedy
    other = one_request(server, prompt, 24, **{**SAMPLED, "seed": 4321})
    assert other["ids"] != alone["ids"] and len(other["ids"]) == 24
    # n = 2 with the seed: choice 0 is the request alone, choice 1 a stream of its own, the same twice
    kw = {**SAMPLED, "extra_body": {**SAMPLED["extra_body"], "return_token_ids": True}}
    twice = [server.client().completions.create(model=MODEL, prompt=prompt, max_tokens=24, n=2, **kw)
             for _ in range(2)]
    ids = [[c.token_ids for c in sorted(t.choices, key=lambda c: c.index)] for t in twice]
    assert ids[0] == ids[1] and ids[0][0] == alone["ids"] and ids[0][1] != alone["ids"]
    for r in results:
        check_usage(r)
        assert r["ids"] and r["finish"] in ("stop", "length")


@heavy
def test_chat_completions(server):
    """Chat, not streamed and streamed (the same greedy answer), usage consistent, the first
    chunk names the assistant; chat_template_kwargs accepted; max_completion_tokens honoured."""
    messages = [{"role": "system", "content": "You write Python."},
                {"role": "user", "content": "Write a function that adds two numbers."}]
    client = server.client()
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0,
                                       extra_body={"return_token_ids": True})
    c = r.choices[0]
    assert r.object == "chat.completion" and r.model == MODEL and r.id.startswith("chatcmpl-")
    assert c.message.role == "assistant" and c.message.content and c.finish_reason in ("stop", "length")
    assert r.usage.completion_tokens == len(c.token_ids) and r.usage.prompt_tokens > 10
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    if c.finish_reason == "length":
        assert len(c.token_ids) == 40

    s = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0, stream=True,
                                       stream_options={"include_usage": True},
                                       extra_body={"return_token_ids": True,
                                                   "chat_template_kwargs": {"enable_thinking": False}})
    content, ids, finish, usage, roles = "", [], None, None, []
    with s:
        for chunk in s:
            assert chunk.object == "chat.completion.chunk"
            if chunk.usage is not None:
                usage = chunk.usage
            if not chunk.choices:
                continue
            d = chunk.choices[0].delta
            roles.append(d.role)
            content += d.content or ""
            ids += getattr(chunk.choices[0], "token_ids", None) or []
            finish = chunk.choices[0].finish_reason or finish
    assert roles[0] == "assistant" and len(roles) > 2
    assert content == c.message.content and ids == c.token_ids and finish == c.finish_reason
    assert usage is not None and usage.completion_tokens == len(ids) and usage.prompt_tokens == r.usage.prompt_tokens

    short = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=3, temperature=0,
                                           extra_body={"return_token_ids": True})
    assert len(c.token_ids) > 3
    assert short.choices[0].token_ids == c.token_ids[:3] and short.usage.completion_tokens == 3
    assert short.choices[0].finish_reason == "length"
    # A stop string cuts the answer where it starts, and the finish reason says so.
    # /metrics counts it as ended, not as cancelled.
    cut = c.message.content[5:9]
    if cut.strip():
        cancelled = 'dflash_requests_finished_total{finish_reason="cancelled"}'
        done = lambda m: sum(v for k, v in m.items() if k.startswith("dflash_requests_finished_total"))
        before = server.wait_idle(timeout=60)
        stopped = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0,
                                                 stop=[cut])
        assert stopped.choices[0].finish_reason == "stop"
        assert stopped.choices[0].message.content == c.message.content[:c.message.content.find(cut)]
        after = server.wait_idle(timeout=60)
        assert done(after) - done(before) == 1 and after.get(cancelled, 0) == before.get(cancelled, 0)


@heavy
def test_bad_requests_answer_in_openai_schema(server):
    import httpx
    import openai

    client = server.client()
    base = dict(model=MODEL, prompt="def f(x):\n", max_tokens=4)
    cases = [
        (dict(n=65), openai.BadRequestError, 400, "n", None, "limit (64 choices"),
        (dict(logprobs=21), openai.BadRequestError, 400, "logprobs", None, "logprobs must be an integer in 0..20"),
        (dict(prompt=[5] * 100), openai.BadRequestError, 400, "prompt", "context_length_exceeded",
         "prompt of 100 tokens is longer than the context (64 tokens)"),
        (dict(max_tokens=1000), openai.BadRequestError, 400, "max_tokens", None, "limit (128"),
        (dict(temperature=-1), openai.BadRequestError, 400, "temperature", None, "temperature"),
        (dict(prompt=[10**7]), openai.BadRequestError, 400, "prompt", None, "outside the vocabulary"),
        (dict(model="gpt-4"), openai.NotFoundError, 404, "model", "model_not_found", "'gpt-4' does not exist"),
        # Once the engine's end (int32 overflow at admission): now refused at the edge.
        (dict(extra_body={"top_k": 2147483648}), openai.BadRequestError, 400, "top_k", None, "top_k must be"),
        (dict(extra_body={"stop_sequences": ["\n"]}), openai.BadRequestError, 400, "stop_sequences", None,
         "did you mean 'stop'?"),
    ]
    for kw, kind, status, param, code, message in cases:
        with pytest.raises(kind) as e:
            client.completions.create(**{**base, **kw})
        err = e.value.response.json()["error"]
        assert e.value.status_code == status and list(err) == ["message", "type", "param", "code"], kw
        assert err["param"] == param and err["code"] == code and message in err["message"], (kw, err)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x " * 80}], max_tokens=4)
    assert e.value.code == "context_length_exceeded" and e.value.param == "messages"

    for body in (b"{not json", b'{"prompt": "x",', b"[1, 2]", b'"x"', b'{"prompt": "\\ud800"}',
                 b'{"prompt": "x", "model": "\\ud800"}'):
        r = httpx.post(server.url + "/v1/completions", content=body, headers={"content-type": "application/json"},
                       timeout=TIMEOUT)
        assert r.status_code == 400, body
        assert r.json()["error"]["type"] == "invalid_request_error" and r.json()["error"]["message"], body
    for kwargs in ({"return_tensors": "np"}, {"padding": "max_length", "max_length": 10**9}):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                           extra_body={"chat_template_kwargs": kwargs})
        assert e.value.param == "chat_template_kwargs"

    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(server.url + "/health", timeout=TIMEOUT).status_code == 200
    assert httpx.get(server.url + "/v1/nothing", timeout=TIMEOUT).status_code == 404
    # The server is unharmed: a good request after the bad ones.
    ok = client.completions.create(**base, temperature=0)
    assert ok.choices[0].text and ok.usage.completion_tokens >= 1


@heavy
def test_abandoned_streams_free_their_slots(server, offline):
    """100 streams (waves of 20 on 4 slots) closed after 0-2 chunks: every one ends cancelled,
    nothing stays running or waiting, and a greedy request afterwards equals its offline output."""
    before = server.metrics()
    cancelled = 'dflash_requests_finished_total{finish_reason="cancelled"}'

    async def abandon(client, k):
        s = await client.completions.create(model=MODEL, prompt=LONG_PROMPTS[k % len(LONG_PROMPTS)], max_tokens=128,
                                            temperature=0, stream=True)
        got = 0
        try:
            if k % 5:  # every fifth closes before a token came (perhaps still waiting for a slot)
                async for _ in s:
                    got += 1
                    if got >= 1 + k % 2:
                        break
        finally:
            await s.close()
        return got

    async def waves():
        async with server.async_client() as client:
            got = []
            for w in range(5):
                got += await asyncio.gather(*[abandon(client, 20 * w + k) for k in range(20)])
            return got

    got = run_async(waves, 240)
    assert len(got) == 100 and sum(g > 0 for g in got) == 80
    after = server.wait_idle(timeout=60)
    done = lambda m: sum(v for k, v in m.items() if k.startswith("dflash_requests_finished_total"))
    assert done(after) - done(before) == 100
    assert after.get(cancelled, 0) - before.get(cancelled, 0) == 100
    i, p, n = PROMPTS[0]
    again = one_request(server, p, n)
    assert again["ids"] == offline[i]["output_ids"] and again["text"] == offline[i]["text"]


@heavy
def test_64_concurrent_clients(server):
    """64 clients at once, streamed and not, greedy and seeded, 8-24 tokens each, distinct
    prompts: all complete, none lost or crossed (ids distinct; a handful sent alone afterwards
    give the same tokens), usage consistent."""
    n = 64
    reqs = []
    for i in range(n):
        kw = {"temperature": 0} if i % 4 != 3 else {"temperature": 0.8, "seed": i}
        reqs.append((f"# task {i}\ndef f{i}(", 8 + i % 17, i % 2 == 0, kw))
    before = server.metrics()

    async def crowd():
        async with server.async_client(timeout=120) as client:
            return await asyncio.gather(*[complete(client, p, m, stream=s, **kw) for p, m, s, kw in reqs])

    t0 = time.monotonic()
    results = run_async(crowd, 300)
    elapsed = time.monotonic() - t0
    assert len(results) == n and len({r["id"] for r in results}) == n
    for (p, m, _, _), r in zip(reqs, results):
        assert r["ids"] and r["finish"] in ("stop", "length"), p
        assert len(r["ids"]) == m if r["finish"] == "length" else len(r["ids"]) <= m
        check_usage(r)
    after = server.wait_idle()
    done = lambda m: sum(v for k, v in m.items() if k.startswith("dflash_requests_finished_total"))
    assert done(after) - done(before) == n
    assert after["dflash_generation_tokens_total"] - before["dflash_generation_tokens_total"] == \
        sum(len(r["ids"]) for r in results)
    assert after["dflash_slot_occupancy"] > 0
    # No crossed wires: the same prompt alone gives the same tokens (greedy and seeded alike).
    for i in (0, 1, 3, 17, 42, 63):
        p, m, s, kw = reqs[i]
        alone = one_request(server, p, m, **kw)
        assert alone["ids"] == results[i]["ids"] and alone["text"] == results[i]["text"], i
    print(f"64 clients in {elapsed:.1f}s")


@heavy
def test_full_queue_answers_429(server):
    """4 long rows hold the slots; streams opened one after another fill the 80-request queue and
    the next is refused with 429 (rate_limit_error, queue_full), not retried. Closing them all
    frees everything."""
    import openai

    client = server.client()
    streams, refused = [], None
    try:
        for k in range(4 + 80 + 10):
            try:
                streams.append(client.completions.create(model=MODEL, prompt=LONG_PROMPTS[k % 4], max_tokens=128,
                                                         temperature=0, stream=True))
            except openai.RateLimitError as e:
                refused = (k, e)
                break
        assert refused is not None, "94 requests were all taken with 4 slots and --max-waiting 80"
        k, e = refused
        # The 4 first rows run for seconds: none finished while the streams were opened.
        assert k == 84, f"refused the {k + 1}-th request"
        assert e.status_code == 429
        err = e.response.json()["error"]
        assert err["type"] == "rate_limit_error" and err["code"] == "queue_full" and "busy" in err["message"]
        m = server.metrics()
        assert m["dflash_requests_waiting"] == 80 and m["dflash_requests_running"] == 4
    finally:
        for s in streams:
            s.close()
    server.wait_idle()
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=2).usage.completion_tokens >= 1


@heavy
def test_structured_output_through_the_openai_client(server):
    """response_format (json_schema, json_object) and vLLM's structured_outputs through the openai client,
    whole and streamed: each answer that ends "stop" is valid; a grammar is a 400 naming its field."""
    import jsonschema
    import openai

    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Zürich"]}, "n": {"type": "integer"}},
              "required": ["city", "n"]}
    client = server.client()
    fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": schema, "strict": True}}
    for temperature in (0, 0.8):
        r = client.chat.completions.create(model="dflash-demo", messages=CHAT, max_tokens=48, seed=3,
                                           temperature=temperature, response_format=fmt)
        assert r.choices[0].finish_reason == "stop", r
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="dflash-demo", messages=CHAT, max_tokens=48, temperature=0, response_format=fmt, stream=True)
        if c.choices)
    jsonschema.validate(json.loads(text), schema)
    r = client.completions.create(model="dflash-demo", prompt="x = ", max_tokens=24, temperature=0,
                                  extra_body={"structured_outputs": {"regex": "[0-9]{3}-[ab]{2}"}})
    assert re.fullmatch("[0-9]{3}-[ab]{2}", r.choices[0].text), r.choices[0].text
    r = client.chat.completions.create(model="dflash-demo", messages=CHAT, max_tokens=48, temperature=0,
                                       response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="dflash-demo", prompt="x", max_tokens=4,
                                  extra_body={"structured_outputs": {"grammar": "root ::= \"a\""}})
    assert e.value.body["param"] == "structured_outputs" and "context-free" in e.value.body["message"]


# A hermes-style template (Qwen3's way of offering tools), brought by the request: the demo's own takes none.
TOOLS_TEMPLATE = ("{% if tools %}tools: {% for t in tools %}{{ t.function.name }} {% endfor %}\n{% endif %}"
                  "{% for m in messages %}{{ m.content }}\n{% endfor %}")
CITY = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer"}},
    "required": ["city", "days"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}


@heavy
def test_tools_and_logprobs_through_the_openai_client(server):
    """tools through the openai client against the served demo pair: tool_choice "required" (greedy and
    seeded sampled, whole and streamed) and a named function always answer a call whose arguments
    validate against the function's schema (finish_reason "tool_calls"); "auto" answers text or calls,
    never both lost; logprobs (chat and completions) come with every token, the greedy token's own the
    best of its alternatives."""
    import jsonschema
    import openai

    client = server.client()
    extra = {"chat_template": TOOLS_TEMPLATE}
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (CITY, CLOCK)}
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    calls = 0
    for seed, temperature in ((0, 0.0), (1, 0.8), (2, 0.8), (3, 1.0)):
        r = client.chat.completions.create(model=MODEL, messages=msgs, tools=[CITY, CLOCK], tool_choice="required",
                                           max_tokens=96, temperature=temperature, seed=seed, extra_body=extra)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
            calls += 1
    assert calls >= 4
    named = client.chat.completions.create(model=MODEL, messages=msgs, tools=[CITY, CLOCK], max_tokens=96,
                                           tool_choice={"type": "function", "function": {"name": "get_time"}},
                                           temperature=0, extra_body=extra)
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "get_time" and call.id
    jsonschema.validate(json.loads(call.function.arguments), schemas["get_time"])
    # streamed: OpenAI's tool-call deltas, the arguments in pieces; no marker text leaks into content
    pieces, content, finish = {}, "", None
    for c in client.chat.completions.create(model=MODEL, messages=msgs, tools=[CITY], tool_choice="required",
                                            max_tokens=96, temperature=0, stream=True, extra_body=extra):
        if not c.choices:
            continue
        delta = c.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or []:
            entry = pieces.setdefault(d.index, {"name": None, "arguments": ""})
            entry["name"] = entry["name"] or (d.function.name if d.function else None)
            entry["arguments"] += (d.function.arguments or "") if d.function else ""
        finish = c.choices[0].finish_reason or finish
    assert finish == "tool_calls" and pieces and "<tool_call>" not in content, (finish, pieces, content)
    for entry in pieces.values():
        assert entry["name"] == "get_weather"
        jsonschema.validate(json.loads(entry["arguments"]), schemas["get_weather"])
    auto = client.chat.completions.create(model=MODEL, messages=msgs, tools=[CITY], max_tokens=32, temperature=0,
                                          extra_body=extra)
    message = auto.choices[0].message
    assert message.tool_calls or message.content, message
    if message.tool_calls:
        assert auto.choices[0].finish_reason == "tool_calls"
    with pytest.raises(openai.BadRequestError) as e:  # a request template that drops the tools
        client.chat.completions.create(model=MODEL, messages=msgs, tools=[CITY], max_tokens=4,
                                       extra_body={"chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"})
    assert e.value.body["param"] == "tools" and "request's chat_template takes no tools" in e.value.body["message"]

    # logprobs: one entry per token; greedy, the token's own log-probability is the best alternative's
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0, logprobs=True,
                                       top_logprobs=3)
    entries = r.choices[0].logprobs.content
    assert len(entries) == r.usage.completion_tokens
    for e in entries:
        assert len(e.top_logprobs) == 3 and e.logprob <= 0
        assert e.logprob == pytest.approx(e.top_logprobs[0].logprob, abs=1e-5) and e.token == e.top_logprobs[0].token
    r = client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=8, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    assert all(len(t) <= 2 and max(t.values()) == pytest.approx(v, abs=1e-5) for t, v in zip(lp.top_logprobs,
                                                                                            lp.token_logprobs))


@heavy
def test_sigterm_lets_a_stream_in_flight_finish(server):
    """Last: SIGTERM while a stream runs. New connections are refused at once; the stream goes
    on to its finish reason and [DONE]; the process exits 0."""
    import httpx

    lines, ended, failure = [], threading.Event(), []
    started = threading.Event()

    def read():
        try:
            with httpx.stream("POST", server.url + "/v1/completions", timeout=TIMEOUT,
                              json={"model": MODEL, "prompt": LONG_PROMPTS[0], "max_tokens": 128, "temperature": 0,
                                    "stream": True, "return_token_ids": True}) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                        started.set()
        except BaseException as e:  # reported below
            failure.append(e)
        finally:
            started.set()
            ended.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert started.wait(TIMEOUT), "no chunk came"
    at_signal = len(lines)
    server.proc.send_signal(signal.SIGTERM)
    refused = False
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not refused:
        try:
            socket.create_connection(("127.0.0.1", server.port), timeout=2).close()
            time.sleep(0.05)
        except OSError:
            refused = True
    refused_while_streaming = refused and not ended.is_set()
    assert ended.wait(TIMEOUT), "the stream did not end"
    assert not failure, f"the stream failed: {failure[0]!r}\n{tail(server.log)}"
    assert refused, "the server still took connections 10 s after SIGTERM"
    assert refused_while_streaming, "the stream ended before new connections were refused: too short a test"
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert len(chunks) > at_signal + 1  # tokens came after the signal
    ids = [t for c in chunks for t in c["choices"][0]["token_ids"]]
    assert len(ids) == 128 and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    code = server.stop(timeout=60)
    assert code == 0, f"the server exited {code} on SIGTERM:\n{tail(server.log)}"
    assert "Traceback" not in server.log.read_text(errors="replace"), tail(server.log)


@pytest.mark.parametrize("choice", ["required", pytest.param({"type": "function", "function": {"name": "get_weather"}},
                                                            marks=pytest.mark.heavy)])
def test_a_required_tool_call_is_constrained_to_a_call_the_reader_parses(choice):
    """tool_choice "required" or a named function: the request's constraint (compiled on the demo
    tokenizer) admits only one call in the target's format (hermes here) whose arguments are valid
    against the function's schema: random walks of its automaton, decoded, read back as exactly one
    call by the same reader "auto" uses."""
    import jsonschema
    import numpy as np
    from transformers import AutoTokenizer

    from dflash_jax.constrain import ConstraintCache, vocabulary_of
    from dflash_jax.pair import DEMO_DIR
    from infer.serve.prepare import prepare_request

    tok = AutoTokenizer.from_pretrained(DEMO_DIR / "target")
    eos = tok.eos_token_id
    served = fake_served()
    served.constraints = ConstraintCache(vocabulary_of(tok, 4096, [eos]))
    served.engine.check_constraint = lambda automaton: None
    other = {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
    body = {"messages": CHAT, "tools": [WEATHER, other], "tool_choice": choice}
    prepared = prepare_request(served, body, True)
    automaton = prepared.sampling.constraint
    schemas = {t["function"]["name"]: t["function"].get("parameters", {}) for t in (WEATHER, other)}
    rng = np.random.RandomState(0)
    for _ in range(12):
        state, ids = automaton.initial, []
        while len(ids) < 400:
            allowed = automaton.allowed(state)
            if automaton.final[state] and (rng.rand() < 0.5 or len(allowed) == 1):
                break
            token = int(rng.choice([t for t in allowed if t != eos]))
            ids.append(token)
            state = automaton.next(state, token)
        assert automaton.final[state], "the walk never completed a call"
        content, calls = prepared.tools.reader().parse(tok.decode(ids))
        assert not content and len(calls) == 1, (tok.decode(ids), content, calls)
        name = calls[0].name
        assert name == "get_weather" or choice == "required"
        jsonschema.validate(json.loads(calls[0].arguments), schemas[name])
