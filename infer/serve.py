"""`python -m infer.serve`: an OpenAI-compatible HTTP server over the continuous-batching engine.

    python -m infer.serve                                   # the bundled demo pair on 127.0.0.1:8000
    python -m infer.serve --target DIR --drafter DIR --batch-size 32 --port 8000

Endpoints: POST /v1/completions and /v1/chat/completions (`stream: true` sends server-sent events
ending in `data: [DONE]`, with `stream_options.include_usage`), GET /v1/models, /health and
/metrics (Prometheus). Every request runs as one row of the engine's batch
(`dflash_jax.engine.streaming`) with its own max_tokens, temperature, top_p, top_k and seed, so
greedy and sampled requests share a batch and nothing recompiles after start-up. Tokens reach
the client at every sync of the engine (`--sync-every` cycles).

A thin edge: it parses requests, turns them into token ids and engine Requests, and turns the
engine's tokens back into text and OpenAI's response schema.
"""


import argparse
import asyncio
import contextlib
import json
import os
import secrets
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

from dflash_jax.errors import DFlashError

MODEL_DEFAULT_NAME = "dflash-demo"


class APIError(Exception):
    """An error answered in OpenAI's schema: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, type: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# --------------------------------------------------------------------------- flags


def build_parser() -> argparse.ArgumentParser:
    from infer.flags import HelpFormatter

    p = argparse.ArgumentParser(
        prog="python -m infer.serve", formatter_class=HelpFormatter,
        description="Serve a target and DFlash drafter behind an OpenAI-compatible HTTP API (completions, chat "
                    "completions, streaming). With no --target, serves the bundled demo pair.")
    p.add_argument("--target", "--model", dest="target", metavar="DIR", help="target model directory")
    p.add_argument("--drafter", "--draft-model", dest="drafter", metavar="DIR",
                   help="DFlash drafter; without it, plain decoding")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send and /v1/models lists (default: the target directory's name)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1 requests")
    p.add_argument("--batch-size", type=int, default=8, help="requests decoded together (slots)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="the most tokens a request may ask for, which sizes the cache (default 256; 128 for the demo)")
    p.add_argument("--max-prompt-len", type=int, default=None,
                   help="longest prompt in tokens, which sizes the cache (default: the target's context, at most 2048)")
    p.add_argument("--max-waiting", type=int, default=256,
                   help="requests queued for a slot; more are answered 429")
    p.add_argument("--block-size", type=int, default=None, help="default: the drafter's; 1 = plain decoding")
    p.add_argument("--draft-tokens", type=int, default=None, metavar="K", help="drafts verified per cycle (default B-1)")
    p.add_argument("--sync-every", type=int, default=2,
                   help="decoding cycles per host sync: tokens reach clients at each; fewer syncs cost the host "
                        "less, more keep the inter-token latency near one cycle")
    p.add_argument("--prefill-chunk", type=int, default=512, metavar="N",
                   help="prompts longer than N tokens (a power of two >= 16) are prefilled N at a time, one piece "
                        "between rounds of cycles, so the running streams never wait for a whole long prompt")
    p.add_argument("--all-admission-widths", action="store_true",
                   help="prefill requests that arrive together at every power-of-two width up to the batch (one "
                        "compiled program each per prompt bucket); by default only 1 and the batch: half the "
                        "programs to compile at start-up, a few requests arriving together are prefilled one by one")
    p.add_argument("--kv-pages", type=int, default=None, metavar="N", help="K/V in a pool of N pages shared by rows")
    p.add_argument("--page-size", type=int, default=128, help="K/V positions per page")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default=None, help="parameter dtype")
    p.add_argument("--mesh", default=None, metavar="data=D,model=M", help="device mesh (as python -m infer)")
    p.add_argument("--enable-thinking", action="store_true",
                   help="chat template default for enable_thinking (a request's chat_template_kwargs overrides it)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM, how long requests in flight may run on before they are cancelled")
    p.add_argument("--stall-timeout", type=float, default=10.0, metavar="MINUTES",
                   help="end the server when the device makes no progress for this long (0: never)")
    p.add_argument("--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug"),
                   help="uvicorn's log level")
    return p


# --------------------------------------------------------------------------- the engine


class Served:
    """The model behind the server: tokenizer, stop tokens and the streaming engine.

    Made in two steps, so that the port opens at once: the constructor checks the flags and
    reads the configs and the tokenizer (a bad flag or model directory is a one-line error
    before the server starts), and `load` (on a thread, while the server answers /health with
    503 "warming up") reads the weights, compiles every program serving runs and starts the
    engine. `state`: "loading", "compiling", "ready" or "failed" (`failure` says why)."""

    def __init__(self, args, say=lambda *a: print(*a, file=sys.stderr, flush=True)):
        from dflash_jax.checkpoint import read_model_config
        from dflash_jax.generation import DEMO_DIR, load_tokenizer, stop_token_ids

        if args.target is None and args.drafter is not None:
            raise DFlashError("--drafter needs --target, the model it drafts for")
        demo = args.target is None
        self.args, self.say = args, say
        self.target_dir = Path(args.target) if args.target else DEMO_DIR / "target"
        self.drafter_dir = Path(args.drafter) if args.drafter else (DEMO_DIR / "drafter" if demo else None)
        for flag in ("batch_size", "max_new_tokens", "max_prompt_len", "max_waiting", "block_size", "draft_tokens",
                     "sync_every", "kv_pages", "page_size"):
            value = getattr(args, flag)
            if value is not None and value < 1:
                raise DFlashError(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
        self.name = args.served_model_name or (MODEL_DEFAULT_NAME if demo else self.target_dir.resolve().name)
        self.max_new = args.max_new_tokens or (128 if demo else 256)
        self.tcfg = read_model_config(self.target_dir, "target", dtype=args.dtype)
        self.drafting = self.drafter_dir is not None and args.block_size != 1
        if self.drafting:
            dcfg = read_model_config(self.drafter_dir, "drafter", dtype=args.dtype)
            block = args.block_size or dcfg.block_size
            if args.draft_tokens is not None and args.draft_tokens > block - 1:
                raise DFlashError(f"--draft-tokens {args.draft_tokens} is more than a block of {block} holds "
                                  f"(1..{block - 1})")
        self.max_prompt = args.max_prompt_len or min(2048, self.tcfg.max_position_embeddings)
        self.context = min(self.max_prompt, self.tcfg.max_position_embeddings)
        self.tokenizer = load_tokenizer(self.target_dir)
        self.stops = stop_token_ids(self.target_dir, self.tokenizer)
        self.thinking = args.enable_thinking
        self.engine = None
        self.state, self.detail, self.failure = "loading", "reading the weights", None

    def load(self):
        """Read the weights, compile what serving runs, start the engine (the slow part)."""
        import jax

        from dflash_jax.checkpoint import load_drafter, load_target
        from dflash_jax.compiling import CompileProgress
        from dflash_jax.engine import Generator, Sampling
        from dflash_jax.engine.streaming import StreamingEngine
        from dflash_jax.engine.watchdog import Watchdog
        from dflash_jax.sharding import make_mesh

        args, say = self.args, self.say
        mesh = make_mesh(args.mesh) if (args.mesh or jax.device_count() > 1) else None
        say(f"loading {self.target_dir}" + (f" and {self.drafter_dir}" if self.drafting else ""))
        tcfg, tparams = load_target(self.target_dir, dtype=args.dtype, progress=False, mesh=mesh)
        dcfg = dparams = None
        if self.drafting:
            dcfg, dparams = load_drafter(self.drafter_dir, dtype=args.dtype, progress=False, mesh=mesh)
        watchdog = Watchdog(args.stall_timeout * 60) if args.stall_timeout > 0 else None
        gen = Generator(tcfg, tparams, dcfg, dparams, block_size=args.block_size, batch_size=args.batch_size,
                        max_new_tokens=self.max_new, max_prompt_len=self.max_prompt, sampling=Sampling(per_row=True),
                        stop_token_ids=self.stops, sync_every=args.sync_every, mesh=mesh,
                        draft_tokens=args.draft_tokens if dcfg is not None else None, watchdog=watchdog,
                        kv_pages=args.kv_pages, page_size=args.page_size, prefill_chunk=args.prefill_chunk,
                        admission_widths=None if args.all_admission_widths else (1, args.batch_size))
        self.context = min(gen.max_prompt_len, tcfg.max_position_embeddings)
        # An engine that fails ends the server (exit status 3), after answering every open request
        # with an error: a supervisor restarts it, where a server without an engine would linger.
        engine = StreamingEngine(gen, max_waiting=args.max_waiting,
                                 on_error=lambda e: os.kill(os.getpid(), signal.SIGTERM))
        self.gen = gen
        longer = (f"; longer prompts in pieces of {args.prefill_chunk} between cycles"
                  if engine.interleaves else "")
        self.state = "compiling"
        with CompileProgress(f"compiling (block size {gen.spec.block_size}, batch {args.batch_size}, prompts up "
                             f"to {gen.max_prompt_len} tokens{longer})") as progress:
            def step(done, total, label):
                self.detail = f"compiling {done}/{total}" + (f": {label}" if label else "")
                progress.step(done, total, label)

            buckets = engine.warmup(progress=step)
        say(f"prompt buckets {', '.join(map(str, buckets))}")
        self.engine = engine.start()
        self.state, self.detail = "ready", ""

    # ------------------------------------------------------------------ text

    def encode(self, prompt) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send the prompt as token ids", "prompt")
        return self.tokenizer(prompt, add_special_tokens=True)["input_ids"]

    def chat(self, messages: list[dict], kwargs: dict) -> list[int]:
        if self.tokenizer is None or getattr(self.tokenizer, "chat_template", None) is None:
            raise APIError(400, "this model has no chat template: use /v1/completions", "messages")
        kwargs = {"enable_thinking": self.thinking, **kwargs}
        try:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)
        except Exception as e:  # a template's own errors (a role it does not know, ...)
            raise APIError(400, f"the chat template refused these messages: {str(e).splitlines()[0]}",
                           "messages") from None
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=True)


# --------------------------------------------------------------------------- requests


def _int(body: dict, key: str, lo: int | None = None, hi: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise APIError(400, f"'{key}' must be an integer, got {json.dumps(value)}", key)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f">= {lo}" if hi is None else f"in {lo}..{hi}"
        raise APIError(400, f"'{key}' must be {bounds}, got {value}", key)
    return value


def _float(body: dict, key: str, lo: float, hi: float, default: float, lo_open: bool = False) -> float:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise APIError(400, f"'{key}' must be a number, got {json.dumps(value)}", key)
    if value > hi or value < lo or (lo_open and value == lo):
        raise APIError(400, f"'{key}' must be in {'(' if lo_open else '['}{lo}, {hi}], got {value}", key)
    return float(value)


class Job:
    """A request, checked and encoded: what the engine runs and how its answer is shaped."""

    def __init__(self, served: Served, body: dict, chat: bool):
        from dflash_jax.engine import Sampling

        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        self.chat = chat
        model = body.get("model")
        if model is not None and model != served.name:
            raise APIError(404, f"the model '{model}' does not exist; this server serves '{served.name}'", "model",
                           code="model_not_found")
        if _int(body, "n", 1) not in (None, 1):
            raise APIError(400, "only n = 1 is supported", "n")
        if _int(body, "best_of", 1) not in (None, 1):
            raise APIError(400, "only best_of = 1 is supported", "best_of")
        if body.get("logprobs") not in (None, False) or body.get("top_logprobs") is not None:
            raise APIError(400, "logprobs are not supported", "logprobs")
        if body.get("echo"):
            raise APIError(400, "echo is not supported", "echo")
        if body.get("suffix") is not None:
            raise APIError(400, "suffix is not supported", "suffix")
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise APIError(400, "'messages' must be a non-empty list", "messages")
            self.prompt_ids = served.chat([self._message(m, i) for i, m in enumerate(messages)],
                                          self._template_kwargs(body))
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]  # a batch of one
            if isinstance(prompt, list) and prompt and all(isinstance(t, list) or isinstance(t, str) for t in prompt):
                raise APIError(400, "send one prompt per request (a list of prompts is not supported)", "prompt")
            if isinstance(prompt, list) and not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                raise APIError(400, "'prompt' must be a string or a list of token ids", "prompt")
            if not isinstance(prompt, (str, list)):
                raise APIError(400, "'prompt' must be a string or a list of token ids", "prompt")
            self.prompt_ids = served.encode(prompt)
        top = served.max_new
        tokens = _int(body, "max_completion_tokens", 1) if chat else None
        if tokens is None:
            tokens = _int(body, "max_tokens", 1)
        self.max_tokens = top if tokens is None else tokens
        if self.max_tokens > top:
            raise APIError(400, f"max_tokens {self.max_tokens} is more than this server's limit ({top}, its "
                                f"--max-new-tokens)", "max_tokens")
        temperature = _float(body, "temperature", 0.0, 2.0, 1.0)
        top_p = _float(body, "top_p", 0.0, 1.0, 1.0, lo_open=True)
        top_k = _int(body, "top_k", -1)
        self.sampling = Sampling(temperature, top_k if top_k and top_k > 0 else 0, top_p, per_row=True)
        seed = _int(body, "seed")
        # A seed keys the row's random stream (taken modulo 2**32): the same request with the same
        # seed gets the same tokens, alone or among others. Without one, a fresh stream.
        self.row_id = seed % 2**32 if seed is not None else secrets.randbits(32)
        stop = body.get("stop")
        if isinstance(stop, str):
            stop = [stop]
        if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
            raise APIError(400, "'stop' must be a non-empty string or a list of them", "stop")
        self.stop = list(stop or [])
        stop_ids = body.get("stop_token_ids") or []
        if not (isinstance(stop_ids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids)):
            raise APIError(400, "'stop_token_ids' must be a list of token ids", "stop_token_ids")
        self.stop_ids = set(stop_ids)
        self.stream = bool(body.get("stream"))
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise APIError(400, "'stream_options' must be an object", "stream_options")
        self.include_usage = self.stream and bool(options.get("include_usage"))
        self.return_token_ids = bool(body.get("return_token_ids"))
        why = served.engine.check(self.prompt_ids, self.max_tokens)
        if why:
            raise APIError(400, why, "messages" if chat else "prompt", code="context_length_exceeded"
                           if "longer than the context" in why else None)

    @staticmethod
    def _message(m, i: int) -> dict:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(400, f"messages[{i}] must be an object with a 'role'", f"messages[{i}]")
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text is understood
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise APIError(400, f"messages[{i}].content: only text parts are supported", f"messages[{i}]")
            content = "".join(p["text"] for p in content)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise APIError(400, f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}]")
        return {"role": m["role"], "content": content}

    @staticmethod
    def _template_kwargs(body: dict) -> dict:
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise APIError(400, "'chat_template_kwargs' must be an object", "chat_template_kwargs")
        return dict(kwargs)


class Decoded:
    """A row's tokens as text, released as it grows: stop strings cut it (the row ends there)
    and text that may be the start of a stop string, or half a character, is held back."""

    def __init__(self, served: Served, job: Job):
        self.served, self.job = served, job
        self.ids: list[int] = []
        self.text, self.released = "", 0
        self.stopped = False  # a stop string or a request's stop token ended it
        self.hold = max((len(s) for s in job.stop), default=1) - 1

    def add(self, tokens: list[int]) -> None:
        if self.stopped:
            return
        for j, t in enumerate(tokens):
            if t in self.job.stop_ids:
                tokens, self.stopped = tokens[:j + 1], True
                break
        before = len(self.ids)
        self.ids += tokens
        self.text = self.served.decode(self.ids)
        cut = self._stop_at(self.text)
        if cut is not None:
            # The row ends with the token that completed the stop string: later ones are dropped
            # (from the ids and the usage too), and the text ends before the stop string.
            for k in range(before + 1, len(self.ids) + 1):
                if self._stop_at(self.served.decode(self.ids[:k])) is not None:
                    self.ids = self.ids[:k]
                    break
            self.text, self.stopped = self.text[:cut], True

    def _stop_at(self, text: str) -> int | None:
        """Where the earliest stop string starts in text (None: nowhere); text already released
        holds none, so the search starts just before it."""
        found = [at for s in self.job.stop if (at := text.find(s, max(0, self.released - len(s)))) >= 0]
        return min(found) if found else None

    def delta(self, final: bool) -> str:
        """Text not yet released that can be."""
        end = len(self.text)
        if not final and not self.stopped:
            end -= self.hold
            while end > self.released and self.text[end - 1] == "\ufffd":
                end -= 1
        if end <= self.released:
            return ""
        out, self.released = self.text[self.released:end], end
        return out


# --------------------------------------------------------------------------- the app


def create_app(served: Served, api_key: str | None = None):
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

    from dflash_jax.engine.streaming import Closed, QueueFull
    from dflash_jax.engine.streaming import Request as EngineRequest

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        # Shutting down (SIGTERM): uvicorn has stopped taking connections and let the requests in
        # flight run on (up to --shutdown-timeout); whatever still runs is cancelled.
        if served.engine is not None:
            await asyncio.to_thread(served.engine.close, cancel_running=True, timeout=30)

    app = FastAPI(title="dflash-jax", docs_url=None, redoc_url=None, lifespan=lifespan)
    created = int(time.time())

    @app.exception_handler(APIError)
    async def api_error(_request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request, e):
        return JSONResponse(APIError(400, f"invalid request: {e.errors()[0].get('msg', e)}").body(), status_code=400)

    def authorize(request: Request):
        if api_key is not None and request.headers.get("authorization") != f"Bearer {api_key}":
            raise APIError(401, "invalid or missing API key (send Authorization: Bearer KEY)",
                           type="authentication_error", code="invalid_api_key")

    async def read_body(request: Request) -> dict:
        try:
            return json.loads(await request.body())
        except ValueError:
            raise APIError(400, "the request body is not valid JSON") from None

    def warming() -> APIError | None:
        """503 while the engine loads and compiles (or after it failed to)."""
        state = getattr(served, "state", "ready")
        if state == "ready":
            return None
        if state == "failed":
            return APIError(503, "the server failed to start; see its log", type="server_error", code="unavailable")
        return APIError(503, f"the server is warming up ({served.detail}); retry when /health answers 200",
                        type="server_error", code="warming_up")

    @app.get("/health")
    async def health():
        state = getattr(served, "state", "ready")
        if state != "ready":
            status = "failed" if state == "failed" else "warming up"
            return JSONResponse({"status": status, "detail": served.detail}, status_code=503)
        if not served.engine.alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        return {"object": "list", "data": [{"id": served.name, "object": "model", "created": created,
                                            "owned_by": "dflash-jax", "max_model_len": served.context}]}

    @app.get("/metrics")
    async def metrics():
        ready = served.engine is not None
        text = (render_metrics(served.engine.metrics) if ready else "") + (
            "# HELP dflash_ready 1 once the engine has loaded and compiled (0 while warming up).\n"
            f"# TYPE dflash_ready gauge\ndflash_ready {int(ready)}\n")
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    def start(job: Job):
        """Queue the job on the engine; returns the asyncio queue its (tokens, result) arrive on."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        emit = lambda tokens, result: loop.call_soon_threadsafe(events.put_nowait, (tokens, result))
        req = EngineRequest(job.prompt_ids, job.max_tokens, emit, job.sampling, job.row_id)
        try:
            served.engine.submit(req)
        except QueueFull as e:
            raise APIError(429, f"the server is busy ({e}); retry later", type="rate_limit_error",
                           code="queue_full") from None
        except Closed as e:
            raise APIError(503, str(e), type="server_error", code="unavailable") from None
        except DFlashError as e:
            raise APIError(400, str(e)) from None
        return req, events

    def finish_reason(decoded: Decoded, result) -> str:
        return "stop" if decoded.stopped or result.finish_reason == "stop" else "length"

    def usage(job: Job, decoded: Decoded) -> dict:
        n = len(decoded.ids)
        return {"prompt_tokens": len(job.prompt_ids), "completion_tokens": n, "total_tokens": len(job.prompt_ids) + n}

    async def complete(request: Request, chat: bool):
        authorize(request)
        not_ready = warming()
        if not_ready is not None:
            raise not_ready
        job = Job(served, await read_body(request), chat)
        req, events = start(job)
        decoded = Decoded(served, job)
        ident = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        kind = "chat.completion" if chat else "text_completion"
        if job.stream:
            return StreamingResponse(stream(req, events, job, decoded, ident, kind), media_type="text/event-stream")
        try:
            result = None
            while result is None:
                try:
                    tokens, result = await asyncio.wait_for(events.get(), timeout=1.0)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        req.cancelled = True  # the client went away: its slot is freed at the next sync
                        return None
                    continue
                decoded.add(tokens)
                if decoded.stopped:
                    req.stopped = req.cancelled = True  # ends as "stop" at the engine's next sync
        finally:
            if result is None:
                req.cancelled = True
        if result.finish_reason == "error":
            raise APIError(500, "the engine failed; see the server's log", type="server_error")
        choice = {"index": 0, "finish_reason": finish_reason(decoded, result), "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": decoded.text}
        else:
            choice["text"] = decoded.text
        if job.return_token_ids:
            choice["token_ids"] = decoded.ids
        return {"id": ident, "object": kind, "created": int(time.time()), "model": served.name, "choices": [choice],
                "usage": usage(job, decoded)}

    async def stream(req, events, job: Job, decoded: Decoded, ident: str, kind: str):
        chunk_kind = "chat.completion.chunk" if job.chat else "text_completion"
        now = int(time.time())

        def chunk(text: str | None, reason: str | None, ids: list[int] | None = None, role: bool = False) -> str:
            choice: dict = {"index": 0, "finish_reason": reason, "logprobs": None}
            if job.chat:
                delta: dict = {"role": "assistant"} if role else {}
                if text is not None:
                    delta["content"] = text
                choice["delta"] = delta
            else:
                choice["text"] = text or ""
            if ids is not None and job.return_token_ids:
                choice["token_ids"] = ids
            body = {"id": ident, "object": chunk_kind, "created": now, "model": served.name, "choices": [choice]}
            if job.include_usage:
                body["usage"] = None
            return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

        result = None
        try:
            if job.chat:
                yield chunk("", None, role=True)
            while result is None:
                tokens, result = await events.get()
                was = len(decoded.ids)
                decoded.add(tokens)
                if decoded.stopped and result is None:
                    req.stopped = req.cancelled = True  # a stop string: the row ends ("stop") at the next sync
                final = result is not None
                text = decoded.delta(final=final)
                new_ids = decoded.ids[was:]
                if final:
                    if result.finish_reason == "error":
                        err = APIError(500, "the engine failed; see the server's log", type="server_error")
                        yield f"data: {json.dumps(err.body())}\n\n"
                        return
                    yield chunk(text, finish_reason(decoded, result), new_ids)
                elif text or new_ids:
                    yield chunk(text, None, new_ids)
            if job.include_usage:
                body = {"id": ident, "object": chunk_kind, "created": now, "model": served.name, "choices": [],
                        "usage": usage(job, decoded)}
                yield f"data: {json.dumps(body)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            if result is None:
                req.cancelled = True  # the client went away (or the server is stopping): free the slot

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await complete(request, chat=True)

    return app


def render_metrics(m) -> str:
    """The engine's figures in Prometheus's text format."""
    lines: list[str] = []

    def metric(name, kind, help_text, samples):
        lines.append(f"# HELP dflash_{name} {help_text}")
        lines.append(f"# TYPE dflash_{name} {kind}")
        for labels, value in samples:
            lines.append(f"dflash_{name}{labels} {value}")

    def histogram(name, help_text, h):
        samples, seen = [], 0
        for bound, n in zip(h.bounds, h.counts):
            seen += n
            samples.append((f'_bucket{{le="{bound}"}}', seen))
        samples += [('_bucket{le="+Inf"}', h.count), ("_sum", round(h.sum, 6)), ("_count", h.count)]
        metric(name, "histogram", help_text, samples)

    with m.lock:
        metric("requests_running", "gauge", "Requests decoding in a slot.", [("", m.running)])
        metric("requests_waiting", "gauge", "Requests queued for a slot.", [("", m.waiting)])
        metric("requests_finished_total", "counter", "Requests ended, by finish reason.",
               [(f'{{finish_reason="{k}"}}', v) for k, v in sorted(m.requests.items())] or [('{finish_reason="stop"}', 0)])
        metric("prompt_tokens_total", "counter", "Prompt tokens admitted.", [("", m.prompt_tokens)])
        metric("generation_tokens_total", "counter", "Tokens generated and sent.", [("", m.generation_tokens)])
        metric("tokens_per_second", "gauge", "Tokens generated per second of time with requests running.",
               [("", round(m.tokens_per_second, 3))])
        metric("tau", "gauge", "Mean acceptance length (tokens per decoding cycle) of finished requests.",
               [("", round(m.tau, 4))])
        histogram("acceptance_length", "Tokens accepted per decoding cycle (the acceptance length).", m.acceptance)
        histogram("time_to_first_token_seconds", "From a request's arrival to its first token.", m.ttft)
        histogram("inter_token_latency_seconds", "Between a stream's successive deliveries of tokens.", m.itl)
        metric("slot_occupancy", "gauge", "Share of slot-syncs that held a running request.",
               [("", round(m.occupancy, 4))])
        metric("batch_slots", "gauge", "Slots of the engine's batch.", [("", m.batch_size)])
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- main


def main(argv=None) -> int:
    """Exit status: 0 after a requested shutdown (SIGTERM, SIGINT); 2 for bad flags or a model
    that cannot load; 3 when the engine failed while serving (or the device stalled)."""
    args = build_parser().parse_args(argv)
    try:
        import uvicorn
    except ImportError:
        print("error: the server needs fastapi and uvicorn: pip install fastapi uvicorn", file=sys.stderr)
        return 2
    from dflash_jax.compiling import enable_compile_cache

    try:
        served = Served(args)
    except DFlashError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cache = enable_compile_cache(lambda *a: print(*a, file=sys.stderr))
    app = create_app(served, args.api_key)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.shutdown_timeout)
    server = uvicorn.Server(config)
    url = f"http://{args.host}:{args.port}"

    def load():
        try:
            served.load()
        except BaseException as e:  # noqa: B036 (the thread's end: whatever it was, the server stops)
            served.failure, served.state = e, "failed"
            if isinstance(e, DFlashError):
                print(f"error: {e}", file=sys.stderr, flush=True)
            else:
                traceback.print_exc()
            server.should_exit = True
            return
        print(f"serving {served.name} on {url}/v1 (batch {args.batch_size}, max_tokens <= {served.max_new}, "
              f"context {served.context})", file=sys.stderr, flush=True)

    print(f"listening on {url}: /health answers 503 \"warming up\" until the engine has loaded and compiled "
          f"(a first start compiles every program; {'a restart loads them from ' + cache if cache else 'no compilation cache'})",
          file=sys.stderr, flush=True)
    threading.Thread(target=load, name="dflash-load", daemon=True).start()
    # uvicorn shuts down gracefully on SIGTERM / SIGINT, then raises the signal again under the
    # handlers it found: these note it, so that a requested shutdown exits 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run()
    if served.failure is not None:
        return 2 if isinstance(served.failure, DFlashError) else 1
    if served.engine is not None and served.engine.error is not None:
        print(f"error: the engine failed: {served.engine.error}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
