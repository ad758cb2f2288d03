"""The server's transport and the truth of its answers (`infer.serve`): no request can hold the
others, and no answer says it is whole when it was cut.

Everyday (scripted engines, no model; well under a second each but the tokenizer's): the request
guard (401 before the body is read, 413 from Content-Length or counted as a chunked body arrives,
408 for a body that stalls), a slow tokenizer that does not hold /health, a row the server cancelled
answered 503 or ended with an SSE error event (no `[DONE]`), SIGTERM's order against uvicorn
(the engine cancels first, each open request writes its error, then the server closes), the API
key on every path but /health, `StreamedText`'s incremental decode against a whole decode with the
demo tokenizer, /health's compile step against the log's, and the signal handlers put back over a
native runtime's.

Heavy (`-m heavy`): the demo pair served and SIGTERMed with requests in flight: every answer is
whole or says it was cut, and the process exits 0 with no traceback.
"""

from __future__ import annotations

import asyncio
import io
import json
import random
import re
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
from test_serve import CHAT, REPO, START_TIMEOUT, FakeEngine, events, fake_served, free_port, tail

from infer.serve.streaming import StreamedText

heavy = pytest.mark.heavy


def make_app(engine=None, **kw):
    from infer.serve.app import create_app

    served = fake_served()
    served.engine, served.context = engine or FakeEngine(), 64
    return create_app(served, **kw)


async def call(app, method: str, path: str, headers=(), receive=None) -> tuple[int, dict, bytes]:
    """One request straight through the ASGI app: (status, headers, body). `receive`: the
    request's body messages (an async callable); by default one that fails the test if called."""
    async def unread():
        pytest.fail("the request's body was read")

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "path": path,
             "raw_path": path.encode(), "query_string": b"", "root_path": "", "scheme": "http",
             "headers": [(k.lower().encode(), v.encode()) for k, v in headers], "client": ("127.0.0.1", 1),
             "server": ("127.0.0.1", 80)}
    sent = []

    async def send(message):
        sent.append(message)

    await app(scope, receive or unread, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], {k.decode(): v.decode() for k, v in start["headers"]}, body


def chunks_of(body: bytes, size: int, log: list | None = None):
    """A receive() handing body over in pieces of `size` bytes (a chunked upload), noting each call
    in `log`; after the body it waits, as a server's does until the client goes."""
    pieces = [body[i:i + size] for i in range(0, len(body), size)] or [b""]
    log = [] if log is None else log

    async def receive():
        if len(log) >= len(pieces):
            await asyncio.Event().wait()
        log.append(len(log))
        return {"type": "http.request", "body": pieces[len(log) - 1], "more_body": len(log) < len(pieces)}

    return receive


def error_of(status: int, body: bytes, code: str | None = None) -> dict:
    err = json.loads(body)["error"]
    assert list(err) == ["message", "type", "param", "code"] and err["message"], body
    if code is not None:
        assert err["code"] == code, err
    return err


# ----------------------------------------------------------------------------- everyday: the guard


def test_an_api_key_is_checked_before_the_body_and_on_every_path_but_health():
    """With --api-key, /v1/*, /metrics, /openapi.json (and unknown paths) answer 401 in OpenAI's
    schema without reading the body (`call`'s default receive fails the test if called); /health
    needs none; the scheme is read in any case, the key exactly."""
    app = make_app(api_key="s3cret")

    async def go():
        for method, path in (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
                             ("GET", "/metrics"), ("GET", "/openapi.json"), ("GET", "/nowhere")):
            for auth in (None, "Bearer nope", "Bearer s3cret2", "Basic s3cret", "Bearers3cret", "s3cret", "Bearer "):
                headers = [("content-length", str(200 << 20))] + ([("authorization", auth)] if auth else [])
                status, got, body = await call(app, method, path, headers)
                assert status == 401, (method, path, auth)
                err = error_of(status, body, "invalid_api_key")
                assert err["type"] == "authentication_error" and got["www-authenticate"] == "Bearer"
                assert got["connection"] == "close"
        status, _, body = await call(app, "GET", "/health", receive=chunks_of(b"", 1))
        assert status == 200 and json.loads(body) == {"status": "ok"}
        for scheme in ("Bearer", "bearer", "BEARER", "bEaReR"):
            for path in ("/metrics", "/openapi.json", "/v1/models"):
                status, _, _ = await call(app, "GET", path, [("authorization", f"{scheme} s3cret")],
                                          receive=chunks_of(b"", 1))
                assert status == 200, (scheme, path)
        status, _, body = await call(app, "POST", "/v1/completions", [("authorization", "bearer s3cret")],
                                     receive=chunks_of(b'{"prompt": "xy", "max_tokens": 3}', 7, []))
        assert status == 200 and json.loads(body)["choices"][0]["text"] == "bde"

    asyncio.run(go())


def test_a_body_over_the_limit_is_answered_413_from_its_length_or_as_it_arrives():
    app = make_app(max_request_bytes=100)
    body = json.dumps({"prompt": "x" * 200}).encode()

    async def go():
        # Content-Length says it: 413 at once, the body unread.
        status, headers, answer = await call(app, "POST", "/v1/completions", [("content-length", str(len(body)))])
        assert status == 413 and headers["connection"] == "close"
        assert "100 bytes" in error_of(status, answer, "request_too_large")["message"]
        # Chunked, no Content-Length: cut once the bytes counted pass the limit, the rest unread.
        log = []
        status, headers, answer = await call(app, "POST", "/v1/completions", [("transfer-encoding", "chunked")],
                                             receive=chunks_of(body, 30, log))
        assert status == 413 and headers["connection"] == "close" and len(log) == 4  # 120 bytes > 100
        error_of(status, answer, "request_too_large")
        # Within the limit, in pieces: the app reads the whole body, as if it came at once.
        small = b'{"prompt": "xy", "max_tokens": 3}'
        status, _, answer = await call(app, "POST", "/v1/completions", [("transfer-encoding", "chunked")],
                                       receive=chunks_of(small, 5, []))
        assert status == 200 and json.loads(answer)["choices"][0]["text"] == "bde"
        status, _, answer = await call(app, "POST", "/v1/completions", [("content-length", "x")])
        assert status == 400 and error_of(status, answer)

    asyncio.run(go())


def test_a_body_that_stalls_is_answered_408():
    """Headers, half a body, then nothing: 408 once --request-read-timeout has passed, and the
    connection closes; the handler never ran (the engine got no request)."""
    engine = FakeEngine()
    app = make_app(engine, request_read_timeout=0.2)
    sent = []

    async def stalls():
        if not sent:
            sent.append(1)
            return {"type": "http.request", "body": b'{"prompt": "x', "more_body": True}
        await asyncio.Event().wait()  # never

    async def go():
        status, headers, body = await asyncio.wait_for(
            call(app, "POST", "/v1/completions", [("content-length", "40")], receive=stalls), 30)
        assert status == 408 and headers["connection"] == "close"
        assert "0.2 s" in error_of(status, body, "request_timeout")["message"]

    asyncio.run(go())
    assert engine.requests == []


def test_a_slow_tokenizer_does_not_hold_health_or_other_requests():
    """A prompt being tokenized (here: an encode that waits until the test lets it go) runs on a
    worker thread: /health and another request are answered meanwhile. Were encoding on the
    event loop, /health could not answer before the encode was released (the wait_for fails)."""
    import httpx

    from infer.serve.app import create_app

    started, release = threading.Event(), threading.Event()
    served = fake_served()
    plain = served.encode

    def encode(prompt):
        if prompt == "slow":
            started.set()
            assert release.wait(30), "the test never released the encode"
        return plain(prompt)

    served.encode, served.engine, served.context = encode, FakeEngine(), 64
    app = create_app(served)

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            slow = asyncio.create_task(client.post("/v1/completions", json={"prompt": "slow", "max_tokens": 3}))
            while not started.is_set():
                await asyncio.sleep(0.01)
            health = await asyncio.wait_for(client.get("/health"), 10)
            other = await asyncio.wait_for(client.post("/v1/completions", json={"prompt": "xy", "max_tokens": 3}), 10)
            assert not slow.done()  # still encoding: /health and the other request did not wait for it
            release.set()
            r = await asyncio.wait_for(slow, 10)
        assert health.status_code == 200 and other.status_code == 200 and r.status_code == 200
        assert r.json()["choices"][0]["text"] == "bde"

    try:
        asyncio.run(go())
    finally:
        release.set()


# ----------------------------------------------------------------------------- everyday: cut answers


def test_a_row_the_server_cancelled_is_answered_503_or_an_error_event():
    """A row that ends "cancelled" under a request still listening (the server shutting down) is
    not a whole answer: 503 in OpenAI's schema, not 200 "length"; a stream ends with an error
    event and no [DONE]. An engine failure: 500 / an error event. A row cut after a stop string
    ended its text is whole."""
    from starlette.testclient import TestClient

    for reason, status in (("cancelled", 503), ("error", 500)):
        engine = FakeEngine(reason=reason)
        with TestClient(make_app(engine)) as client:
            for path, body in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", {"messages": CHAT}),
                               ("/v1/completions", {"prompt": "x", "n": 2})):
                r = client.post(path, json=body)
                assert r.status_code == status and r.headers["content-type"] == "application/json", r.text
                err = error_of(status, r.content, "unavailable" if status == 503 else None)
                assert err["type"] == "server_error"
                got = events(client.post(path, json={**body, "stream": True}))
                assert "[DONE]" not in got and got[-1]["error"]["type"] == "server_error"
                assert all("error" not in c for c in got[:-1])
                if status == 503:
                    assert got[-1]["error"]["code"] == "unavailable" and "shutting down" in got[-1]["error"]["message"]
    engine = FakeEngine(chunks=([0, 2], [2, 3]), reason="cancelled")  # "a\n\nd": the stop string came first
    with TestClient(make_app(engine)) as client:
        r = client.post("/v1/completions", json={"prompt": "x", "stop": "\n\n"})
        assert r.status_code == 200 and r.json()["choices"][0] == {"index": 0, "finish_reason": "stop",
                                                                  "logprobs": None, "text": "a"}


class HeldEngine(FakeEngine):
    """A scripted engine whose rows send their first chunk and then run until closed: closing with
    cancel_running ends each with "cancelled", as the StreamingEngine's close does."""

    def __init__(self):
        super().__init__()
        self.release = threading.Event()

    def _play(self, req):
        from dflash_jax.engine.slots import Result

        req.emit([1, 3], None)
        self.release.wait(60)
        req.emit([], Result(req.row_id, [1, 3], [], "cancelled"))

    def close(self, **kw):
        super().close(**kw)
        if kw.get("cancel_running"):
            self.release.set()
        return True


def test_sigterm_cancels_the_engines_rows_before_the_server_closes_their_connections():
    """The shutdown's order, with uvicorn on a socket: on the exit signal the server stops taking
    connections; --shutdown-timeout later the engine cancels what still runs, and each open request
    writes its end (503, or a stream's error event after the tokens it had) before uvicorn, waiting
    SHUTDOWN_GRACE longer, closes the connections."""
    import httpx
    import uvicorn

    from infer.serve.__main__ import SHUTDOWN_GRACE, _cancel_running, _server_class

    engine = HeldEngine()
    app = make_app(engine)
    model = app.state.model
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                            timeout_graceful_shutdown=0.3 + SHUTDOWN_GRACE)
    timer = threading.Timer(0.3, _cancel_running, (model,))
    server = _server_class(uvicorn)(config, model, timer)
    thread = threading.Thread(target=server.run, daemon=True)  # off the main thread: no signal handlers
    thread.start()
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):
        if server.started:
            break
        time.sleep(0.05)
    assert server.started

    results = {}

    def plain():
        results["plain"] = httpx.post(f"{url}/v1/completions", json={"prompt": "x"}, timeout=30)

    def stream():
        with httpx.stream("POST", f"{url}/v1/completions", json={"prompt": "x", "stream": True}, timeout=30) as r:
            results["stream"] = (r.status_code, [line for line in r.iter_lines() if line])

    clients = [threading.Thread(target=plain), threading.Thread(target=stream)]
    for c in clients:
        c.start()
    for _ in range(200):
        if len(engine.requests) == 2:
            break
        time.sleep(0.05)
    assert len(engine.requests) == 2
    server.handle_exit(signal.SIGTERM, None)  # what the signal runs
    for c in clients:
        c.join(30)
    thread.join(30)
    assert not thread.is_alive()
    r = results["plain"]
    assert r.status_code == 503 and error_of(503, r.content, "unavailable")
    status, lines = results["stream"]
    assert status == 200 and lines[-1] != "data: [DONE]"
    assert json.loads(lines[0].removeprefix("data: "))["choices"][0]["text"] == "bd"  # what came before the cut
    assert json.loads(lines[-1].removeprefix("data: "))["error"]["code"] == "unavailable"
    assert engine.closed[0] == {"cancel_running": True, "timeout": SHUTDOWN_GRACE}  # the timer, before the lifespan


def test_bad_transport_flags_are_one_line_errors(capsys):
    from infer.serve.__main__ import main

    for flags in (["--max-request-bytes", "0"], ["--request-read-timeout", "0"], ["--shutdown-timeout", "-1"]):
        assert main(flags) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"error: {flags[0]} must be") and "\n" not in err


def test_the_signal_handlers_are_put_back_over_a_native_runtimes():
    """A native library (libtpu) that installs its own SIGTERM handler with sigaction, unseen by
    Python, would print its stack trace on SIGTERM; `_reassert_signal_handlers` puts Python's back.
    Here the native handler is SIG_DFL (the process would die of the signal, status -15)."""
    code = """
import ctypes, os, signal
from infer.serve.__main__ import _reassert_signal_handlers
heard = []
signal.signal(signal.SIGTERM, lambda *a: heard.append(1))
libc = ctypes.CDLL(None)
libc.signal.restype = ctypes.c_void_p
libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
libc.signal(signal.SIGTERM, 0)  # SIG_DFL, behind Python's back
_reassert_signal_handlers()
os.kill(os.getpid(), signal.SIGTERM)
assert heard == [1], heard
print("heard")
"""
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "heard", (r.returncode, r.stderr[-2000:])


# ----------------------------------------------------------------------------- everyday: /health's compile step


def test_health_says_the_compile_step_the_log_says():
    """run_steps calls progress(done, total, label) before each step and once after the last: at
    each call /health's detail is the log line just printed (less its timing)."""
    from dflash_jax.compiling import CompileProgress
    from infer.serve.model import ServedModel

    log, served = io.StringIO(), SimpleNamespace(detail="")
    steps = ["prompts of 16 tokens x 1", "prompts of 16 tokens x 4", "the streaming loop"]
    with CompileProgress("compiling", file=log) as progress:
        step = ServedModel.compile_step(served, progress)
        for done, label in enumerate(steps):
            step(done, len(steps), label)
            line = log.getvalue().splitlines()[-1].strip()
            assert re.fullmatch(rf"compiling {done + 1}/3: {label} \[.*\]", line), line
            assert line.startswith(served.detail + " [") and served.detail == f"compiling {done + 1}/3: {label}"
        step(len(steps), len(steps), "")
        assert served.detail == "compiled 3/3"


# ----------------------------------------------------------------------------- everyday: incremental decoding


class WholeDecode(StreamedText):
    """The reference: the whole text decoded again at every delivery and at every token of a cut."""

    def add(self, tokens):
        if self.stopped:
            return
        for j, t in enumerate(tokens):
            if t in self.request.stop_ids:
                tokens, self.stopped = tokens[:j + 1], True
                break
        before = len(self.ids)
        self.ids += tokens
        self.text = self.model.decode(self.ids)
        cut = self._stop_at(self.text)
        if cut is not None:
            for k in range(before + 1, len(self.ids) + 1):
                if self._stop_at(self.model.decode(self.ids[:k])) is not None:
                    self.ids = self.ids[:k]
                    break
            self.text, self.stopped = self.text[:cut], True


@pytest.fixture(scope="module")
def demo_tokenizer():
    from dflash_jax.pair import DEMO_DIR, load_tokenizer

    return load_tokenizer(DEMO_DIR / "target")


def test_incremental_decoding_equals_the_whole_decode(demo_tokenizer):
    """Token sequences from real text (multi-byte characters, leading spaces, newlines with
    indentation), uniform random ids (half characters, special tokens) and a mix, delivered in random
    pieces, with and without stop strings and stop ids: every delivery's text, ids, stop and
    released deltas equal decoding the whole output each time, as the server did before."""
    tok = demo_tokenizer
    model = SimpleNamespace(decode=lambda ids: tok.decode(ids, skip_special_tokens=True))
    source = (REPO / "infer" / "serve" / "streaming.py").read_text() + "\né中文 ünï 😀 naïve\n\n    x = 'ß'\n"
    text_ids = tok(source)["input_ids"]
    rng = random.Random(0)
    for trial in range(300):
        n = rng.randint(1, 160)
        kind = trial % 3
        if kind == 0:
            start = rng.randrange(len(text_ids) - n)
            ids = text_ids[start:start + n]
        elif kind == 1:
            ids = [rng.randrange(len(tok)) for _ in range(n)]
        else:
            ids = [rng.choice(text_ids) if rng.random() < 0.7 else rng.randrange(len(tok)) for _ in range(n)]
        req = SimpleNamespace(stop=rng.choice([[], ["\n\n"], ["return"], ["\n", "self"], ["\ufffd"], ["é"]]),
                              stop_ids=set(rng.sample(ids, 1)) if rng.random() < 0.2 else set())
        fast, whole = StreamedText(model, req), WholeDecode(model, req)
        i = 0
        while i < len(ids):
            piece = ids[i:i + rng.randint(1, 12)]
            i += len(piece)
            fast.add(piece)
            whole.add(piece)
            assert (fast.text, fast.ids, fast.stopped) == (whole.text, whole.ids, whole.stopped), trial
            assert fast.delta(final=False) == whole.delta(final=False), trial
        assert fast.delta(final=True) == whole.delta(final=True)


def test_incremental_decoding_decodes_a_window_not_the_whole():
    """Each delivery decodes the new ids and a few settled ones, not the whole output."""
    from test_serve import decode

    lengths = []
    model = SimpleNamespace(decode=lambda ids: lengths.append(len(ids)) or decode(ids))
    d = StreamedText(model, SimpleNamespace(stop=["zz"], stop_ids=set()))
    for _ in range(200):
        d.add([0, 1, 3])
    assert d.text == decode([0, 1, 3] * 200)
    assert max(lengths[-20:]) <= StreamedText.WINDOW + 3


# ----------------------------------------------------------------------------- heavy: a real server, SIGTERMed


@heavy
def test_sigterm_with_requests_in_flight_cuts_none_silently(tmp_path):
    """The demo pair served with --shutdown-timeout 0 and three times more long requests than slots,
    half streamed: SIGTERM once the first stream has its first chunk. Each non-streamed answer is
    whole (200, every token asked for, or a stop) or a 503 in OpenAI's schema; each stream ends in
    [DONE] after its finish reason or in an error event; nothing is plain text. The server exits 0,
    its log without a traceback."""
    import httpx

    port, log = free_port(), tmp_path / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "infer.serve", "--port", str(port), "--batch-size", "2",
                                 "--max-prompt-len", "64", "--shutdown-timeout", "0"], cwd=REPO, stdout=out,
                                stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + START_TIMEOUT
        while time.time() < deadline:
            assert proc.poll() is None, tail(log)
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            pytest.fail(f"the server was not ready:\n{tail(log)}")

        async def one(client, k, first: asyncio.Event):
            body = {"prompt": f"def f{k}(x):\n", "max_tokens": 128, "temperature": 0}
            if k % 2:
                lines = []
                async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                    async for line in r.aiter_lines():
                        if line:
                            lines.append(line)
                            first.set()
                    return "stream", r.status_code, lines
            r = await client.post("/v1/completions", json=body)
            return "plain", r.status_code, r

        async def crowd():
            first = asyncio.Event()
            async with httpx.AsyncClient(base_url=url, timeout=120) as client:
                tasks = [asyncio.create_task(one(client, k, first)) for k in range(6)]
                await asyncio.wait_for(first.wait(), 60)
                proc.send_signal(signal.SIGTERM)
                return await asyncio.gather(*tasks)

        answers = asyncio.run(crowd())
        code = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    kinds = []
    for kind, status, got in answers:
        if kind == "plain":
            assert got.headers["content-type"] == "application/json", got.text
            if status == 200:
                choice = got.json()["choices"][0]
                assert choice["finish_reason"] in ("stop", "length")
                if choice["finish_reason"] == "length":
                    assert got.json()["usage"]["completion_tokens"] == 128
            else:
                assert status == 503 and error_of(503, got.content, "unavailable")
            kinds.append(status)
        else:
            assert status == 200 and got
            data = [line.removeprefix("data: ") for line in got]
            if data[-1] == "[DONE]":
                assert json.loads(data[-2])["choices"][0]["finish_reason"] in ("stop", "length")
                kinds.append("done")
            else:
                assert json.loads(data[-1])["error"]["code"] == "unavailable", data[-1]
                kinds.append("cut")
    text = log.read_text()
    assert code == 0, text[-4000:]
    assert "Traceback" not in text and "Exception in ASGI" not in text, text[-4000:]
    # With 2 slots, most of the six were queued or running when the engine cancelled them: cut, and said so.
    assert 503 in kinds and "cut" in kinds, kinds
