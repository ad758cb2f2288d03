"""`python -m infer.serve`: an OpenAI-compatible HTTP server over the continuous-batching engine.

    python -m infer.serve                                   # the bundled demo pair on 127.0.0.1:8000
    python -m infer.serve --target DIR --drafter DIR --batch-size 32 --port 8000

The flags and `main`: check the flags and read the model's configs (a bad one is a one-line
error, exit status 2), open the port at once, load and compile on a thread while /health answers
503, and serve until SIGTERM (exit status 0) or an engine failure (3).
"""

import argparse
import os
import signal
import sys
import threading
import traceback

from dflash_jax.errors import DFlashError

# After --shutdown-timeout the engine cancels what still runs; uvicorn waits this much longer for
# those requests to send their 503s and stream error events before it closes their connections.
SHUTDOWN_GRACE = 5.0

# --------------------------------------------------------------------------- flags


# The engine flags whose meaning is the server's own.
SERVER_HELPS = {
    "constraint_states": "structured output (response_format, structured_outputs, a required tool call): the "
                         "automaton states a request's constraint may have; the device pool holds a region of N per "
                         "slot, 4 bytes per 32 vocabulary tokens a state (19,456 at a 152k vocabulary). Default: 512 "
                         "(every cycle masks its drafts: the chain, a draft tree, a DFlash2 selector); 0: none",
    "batch_size": "requests decoded together (slots)",
    "max_new_tokens": "the most tokens a request may ask for, which sizes the cache (default 256; 128 for the demo)",
    "max_prompt_len": "longest prompt in tokens, which sizes the cache (default: the target's context, at most 2048)",
    "sync_every": "decoding cycles per host sync: tokens reach clients at each; fewer syncs cost the host less, "
                  "more keep the inter-token latency near one cycle",
    "stall_timeout": "end the server when the device makes no progress for this long (0: never)",
    "kv_pages": "keep K/V in a pool of N pages (of --page-size positions) shared by the requests, each holding the "
                "pages of its own prompt and max_tokens (default: a pool of the memory per-row caches would take, "
                "batch x the pages of --max-prompt-len + --max-new-tokens, so no request waits for pages; 0: "
                "per-row caches, no prefix caching). The startup log says which, and why where the pool is refused",
    "prefix_cache": "keep prompts' full pages in the pool cached and share them with later prompts that start the "
                    "same tokens, which prefill only the rest; least recently used pages are evicted (default: on, "
                    "unless the target keeps a per-row ring or state)",
}


def build_parser() -> argparse.ArgumentParser:
    from dflash_jax.engine.options import SERVER_SYNC_EVERY
    from infer.flags import SERVER_ENGINE_FLAGS, HelpFormatter, add_engine_flags

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
    p.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on every path but /health")
    p.add_argument("--max-waiting", type=int, default=256,
                   help="requests queued for a slot; more are answered 429")
    p.add_argument("--all-admission-widths", action="store_true",
                   help="prefill requests that arrive together at every power-of-two width up to the batch (one "
                        "compiled program each per prompt bucket); by default only 1 and the batch: half the "
                        "programs to compile at start-up, a few requests arriving together are prefilled one by one")
    # The engine's flags, shared with python -m infer and the bench; the server syncs more often
    # (SERVER_SYNC_EVERY: tokens reach clients at each sync).
    add_engine_flags(p.add_argument_group("engine"), SERVER_ENGINE_FLAGS,
                     overrides={"sync_every": SERVER_SYNC_EVERY, "constraint_states": None}, helps=SERVER_HELPS)
    p.add_argument("--enable-thinking", action="store_true",
                   help="chat template default for enable_thinking (a request's chat_template_kwargs overrides it)")
    # Transport: what a request may cost the server before it runs, and how a shutdown ends the rest.
    p.add_argument("--max-request-bytes", type=int, default=None, metavar="BYTES",
                   help="the largest request body; larger ones are answered 413 (default: 8 MiB)")
    p.add_argument("--request-read-timeout", type=float, default=None, metavar="SECONDS",
                   help="how long a request's body may take to arrive after its headers; a slower one is answered "
                        "408 and its connection closed (default: 30)")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="let a chat request bring its own chat_template (Jinja run on the server: for trusted clients "
                        "only); without it such a request is answered 400")
    p.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM, how long requests in flight may run on before they are cancelled (each then "
                        "answered 503, or a stream ended with an error event)")
    p.add_argument("--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug"),
                   help="uvicorn's log level")
    return p


# --------------------------------------------------------------------------- main


def main(argv=None) -> int:
    """Exit status: 0 after a requested shutdown (SIGTERM, SIGINT); 2 for bad flags or a model
    that cannot load; 3 when the engine failed while serving (or the device stalled)."""
    args = build_parser().parse_args(argv)
    for flag, value, least in (("--max-request-bytes", args.max_request_bytes, 1),
                               ("--request-read-timeout", args.request_read_timeout, 1e-9),
                               ("--shutdown-timeout", args.shutdown_timeout, 0)):
        if value is not None and value < least:
            print(f"error: {flag} must be {'>= 0' if least == 0 else '> 0'}, got {value:g}", file=sys.stderr)
            return 2
    try:
        import uvicorn
    except ImportError:
        print("error: the server needs fastapi and uvicorn: pip install fastapi uvicorn", file=sys.stderr)
        return 2
    from dflash_jax.compiling import enable_compile_cache
    from infer.serve.app import create_app
    from infer.serve.model import ServedModel

    try:
        model = ServedModel(args)
    except DFlashError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cache = enable_compile_cache(lambda *a: print(*a, file=sys.stderr))
    app = create_app(model, args.api_key, max_request_bytes=args.max_request_bytes,
                     request_read_timeout=args.request_read_timeout)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.shutdown_timeout + SHUTDOWN_GRACE)
    cancel_running = threading.Timer(args.shutdown_timeout, _cancel_running, (model,))
    cancel_running.daemon = True
    server = _server_class(uvicorn)(config, model, cancel_running)
    url = f"http://{args.host}:{args.port}"

    def load():
        try:
            model.load()
        except BaseException as e:  # noqa: B036 (the thread's end: whatever it was, the server stops)
            model.failure, model.state = e, "failed"
            if isinstance(e, DFlashError):
                print(f"error: {e}", file=sys.stderr, flush=True)
            else:
                traceback.print_exc()
            server.should_exit = True
            return
        print(f"serving {model.name} on {url}/v1 (batch {args.batch_size}, max_tokens <= {model.max_new}, "
              f"context {model.context})", file=sys.stderr, flush=True)

    print(f"listening on {url}: /health answers 503 \"warming up\" until the engine has loaded and compiled "
          f"(a first start compiles every program; {'a restart loads them from ' + cache if cache else 'no compilation cache'})",
          file=sys.stderr, flush=True)
    # uvicorn shuts down gracefully on SIGTERM / SIGINT, then raises the signal again under the
    # handlers it found: these note it, so that a requested shutdown exits 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    loader = threading.Thread(target=load, name="dflash-load", daemon=True)
    loader.start()
    server.run()
    cancel_running.cancel()
    if loader.is_alive():  # a shutdown asked for while loading: nothing to finish, and a compile to not wait for
        print("stopped while loading", file=sys.stderr, flush=True)
        os._exit(0)
    if model.failure is not None:
        return 2 if isinstance(model.failure, DFlashError) else 1
    if model.engine is not None and model.engine.error is not None:
        print(f"error: the engine failed: {model.engine.error}", file=sys.stderr)
        return 3
    return 0


def _cancel_running(model) -> None:
    """--shutdown-timeout after SIGTERM: the engine cancels the requests still running, each of
    which then answers that it was cut (503; a stream's error event)."""
    if model.engine is not None:
        model.engine.close(cancel_running=True, timeout=SHUTDOWN_GRACE)


def _server_class(uvicorn):
    class Server(uvicorn.Server):
        """uvicorn's server, its shutdown in the order that lets every open request say how it ended:
        on SIGTERM it stops taking connections and waits for those open (--shutdown-timeout plus
        SHUTDOWN_GRACE), while `cancel_running` (a timer started by the signal) has the engine cancel
        what still runs after --shutdown-timeout, so each of those requests writes its error before
        uvicorn closes the connections.

        While the model loads, it puts its signal handlers back at each tick: an accelerator's
        runtime (libtpu) installs its own for SIGTERM when it starts, which prints a stack trace."""

        def __init__(self, config, model, cancel_running: threading.Timer):
            super().__init__(config)
            self.model, self.cancel_running, self.signals_seen = model, cancel_running, None

        def handle_exit(self, sig, frame):
            if not self.should_exit:
                self.cancel_running.start()
            super().handle_exit(sig, frame)

        async def on_tick(self, counter: int) -> bool:
            state = getattr(self.model, "state", "ready")
            if state in ("loading", "compiling") or state != self.signals_seen:
                _reassert_signal_handlers()
                self.signals_seen = state
            return await super().on_tick(counter)

    return Server


def _reassert_signal_handlers() -> None:
    """Install Python's handlers for SIGTERM and SIGINT again (on the main thread), over whatever
    native code installed since: Python does not see a handler a library sets with sigaction.
    Off the main thread (where uvicorn installs none either) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGTERM, signal.SIGINT):
        handler = signal.getsignal(sig)
        if handler is not None:
            signal.signal(sig, handler)


if __name__ == "__main__":
    sys.exit(main())
