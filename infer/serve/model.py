"""The model the server serves: flags checked, configs and tokenizer read, then (on a thread,
while the port is already open) the weights loaded, every program compiled and the streaming
engine started. Text in and out: prompts and chat messages to token ids, token ids to text.
"""

import os
import signal
import sys
from pathlib import Path

from dflash_jax.errors import DFlashError
from infer.serve.protocol import APIError

MODEL_DEFAULT_NAME = "dflash-demo"


class ServedModel:
    """The model behind the server: its flags, tokenizer, stop tokens and the streaming engine.

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
