"""The model the server serves: flags checked, configs and tokenizer read, then (on a thread,
while the port is already open) the weights loaded, every program compiled and the streaming
engine started. Text in and out: prompts and chat messages to token ids, token ids to text.
"""

import argparse
import dataclasses
import os
import signal
import sys

from dflash_jax.chat import encode_chat, encode_text, has_chat_template
from dflash_jax.errors import DFlashError
from infer.serve.protocol import APIError
from infer.serve.toolcalls.request import ModelTools

MODEL_DEFAULT_NAME = "dflash-demo"


class ServedModel:
    """The model behind the server: its flags, tokenizer, stop tokens and the streaming engine.

    Made in two steps, so that the port opens at once: the constructor checks the flags and
    reads the configs and the tokenizer (a bad flag or model directory is a one-line error
    before the server starts), and `load` (on a thread, while the server answers /health with
    503 "warming up") reads the weights, compiles every program serving runs and starts the
    engine. `state`: "loading", "compiling", "ready" or "failed" (`failure` says why)."""

    def __init__(self, args, say=lambda *a: print(*a, file=sys.stderr, flush=True)):
        from dflash_jax.engine.options import EngineOptions, resolve
        from dflash_jax.engine.sampling import MAX_LOGPROBS
        from dflash_jax.pair import open_pair

        # --kv-pages: unset, a page pool of per-row caches' memory (sized below, `default_pool`); 0: per-row caches
        if args.kv_pages is not None and args.kv_pages < 0:
            raise DFlashError(f"--kv-pages must be >= 0 (0: per-row caches), got {args.kv_pages}")
        self.kv_default = args.kv_pages is None
        flags = argparse.Namespace(**{**vars(args), "kv_pages": args.kv_pages or None,
                                      "prefix_cache": None if self.kv_default else args.prefix_cache,
                                      "constraint_states": args.constraint_states or 0})
        self.options = EngineOptions.of(flags)  # checked once: an out-of-range flag is a one-line error
        # Requests may ask for logprobs (each token's and up to MAX_LOGPROBS alternatives): computed only
        # in cycles where some row asks.
        self.options = dataclasses.replace(self.options, max_logprobs=MAX_LOGPROBS)
        if args.max_waiting < 1:
            raise DFlashError(f"--max-waiting must be >= 1, got {args.max_waiting}")
        self.args, self.say = args, say
        pair = open_pair(args.target, args.drafter, dtype=args.dtype, use_drafter=args.block_size != 1)
        self.pair, self.tcfg, self.drafting = pair, pair.target, pair.drafting
        self.target_dir, self.drafter_dir = pair.target_dir, pair.drafter_dir
        self.options = resolve(pair, self.options)  # block size, draft length and tree checked against the pair
        self.name = args.served_model_name or (MODEL_DEFAULT_NAME if pair.demo else self.target_dir.resolve().name)
        self.max_new = args.max_new_tokens or (128 if pair.demo else 256)
        self.max_prompt = args.max_prompt_len or min(2048, self.tcfg.max_position_embeddings)
        self.context = min(self.max_prompt, self.tcfg.max_position_embeddings)
        if self.kv_default:
            self.options = default_pool(self.options, args, self.max_prompt, self.max_new)
        pair.open_tokenizer()
        self.tokenizer, self.stops = pair.tokenizer, pair.stop_tokens
        self.vocab_size = self.tcfg.vocab_size
        self.options, self.constraints, self.constraint_refusal = constraint_pool(self.options, args, pair)
        self.thinking = args.enable_thinking
        self.tools = ModelTools.of(getattr(self.tcfg, "model_type", None), getattr(self.tokenizer, "chat_template", None))
        self.marker_skips = marker_skips(self.tokenizer, self.tools.format)
        if has_chat_template(self.tokenizer):
            say(self.tools.note())
        # A request's own chat_template is Jinja run on the server: only when the operator says so.
        self.trust_request_chat_template = args.trust_request_chat_template
        self.engine = None
        self._pieces: dict[int, tuple[str, list[int]]] = {}  # token_piece's
        self.state, self.detail, self.failure = "loading", "reading the weights", None

    def load(self):
        """Read the weights, compile what serving runs, start the engine (the slow part)."""
        from dflash_jax.compiling import CompileProgress
        from dflash_jax.engine.streaming import StreamingEngine
        from dflash_jax.pair import engine_mesh

        args, say, options = self.args, self.say, self.options
        say(f"loading {self.target_dir}" + (f" and {self.drafter_dir}" if self.drafting else ""))
        self.pair.load_weights(engine_mesh(options.mesh))
        data = self.pair.mesh.shape["data"] if self.pair.mesh is not None else 1
        refused = None
        if self.kv_default and data > 1:  # the default pool, refused: per-row caches
            refused = f"a page pool is shared by every row, so it needs a mesh whose data axis is 1 (this one's is {data})"
            if options.prefix_cache == "on":
                raise DFlashError(f"--prefix-cache on shares the page pool's pages: {refused}")
            options = self.options = dataclasses.replace(options, kv_pages=None, prefix_cache=None)
        # An engine that fails ends the server (exit status 3), after answering every open request
        # with an error: a supervisor restarts it, where a server without an engine would linger.
        engine = StreamingEngine.of(self.pair, options, max_new_tokens=self.max_new, max_prompt_len=self.max_prompt,
                                    max_waiting=args.max_waiting, on_error=lambda e: os.kill(os.getpid(), signal.SIGTERM),
                                    admission_widths=None if args.all_admission_widths else (1, args.batch_size))
        gen = engine.gen
        self.context = min(gen.max_prompt_len, self.tcfg.max_position_embeddings)
        self.kv_note = kv_cache_note(gen, self.kv_default, refused)
        say(f"KV cache: {self.kv_note}")
        self.gen = gen
        longer = (f"; longer prompts in pieces of {args.prefill_chunk} between cycles"
                  if engine.interleaves else "")
        self.state = "compiling"
        with CompileProgress(f"compiling (block size {gen.spec.block_size}, batch {args.batch_size}, prompts up "
                             f"to {gen.max_prompt_len} tokens{longer})") as progress:
            buckets = engine.warmup(progress=self.compile_step(progress))
        say(f"prompt buckets {', '.join(map(str, buckets))}")
        self.engine = engine.start()
        self.state, self.detail = "ready", ""

    def compile_step(self, progress):
        """The warm-up's progress callback: `progress`'s (the log's line) and /health's detail,
        which says the same step the log does."""
        from dflash_jax.compiling import step_line

        def step(done: int, total: int, label: str = ""):
            self.detail = step_line(done, total, label)
            progress.step(done, total, label)

        return step

    # ------------------------------------------------------------------ text

    def encode(self, prompt) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send the prompt as token ids", "prompt")
        return encode_text(self.tokenizer, prompt)

    def chat(self, messages: list[dict], kwargs: dict, template: str | None = None) -> list[int]:
        """messages through the chat template (a request's own `template` where the server trusts
        one); kwargs: the template variables `infer.serve.prepare` let through."""
        if template is None and not has_chat_template(self.tokenizer):
            raise APIError(400, "this model has no chat template: use /v1/completions", "messages")
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer: use /v1/completions with token ids", "messages")
        extra = {} if template is None else {"chat_template": template}
        try:
            return encode_chat(self.tokenizer, messages, **{"enable_thinking": self.thinking, **kwargs, **extra})
        except Exception as e:  # a template's own errors (a role it does not know, ...)
            raise APIError(400, f"the chat template refused these messages: {str(e).splitlines()[0]}",
                           "messages") from None

    def token_piece(self, token_id: int) -> tuple[str, list[int]]:
        """A token's string and UTF-8 bytes, as logprobs name it (`infer.serve.logprobs.token_piece`), cached."""
        from infer.serve.logprobs import token_piece

        piece = self._pieces.get(token_id)
        if piece is None:
            piece = self._pieces[token_id] = token_piece(self.tokenizer, token_id)
        return piece

    def decode(self, ids: list[int], keep_markers: bool = False) -> str:
        """ids' text, special tokens skipped; keep_markers: but the tool-call format's markers kept."""
        if self.tokenizer is None:
            return ""
        if keep_markers:
            return self.tokenizer.decode([t for t in ids if t not in self.marker_skips], skip_special_tokens=False)
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def marker_skips(tokenizer, fmt) -> frozenset[int]:
    """The special tokens a decode keeping `fmt`'s markers skips: every special token but those."""
    if tokenizer is None:
        return frozenset()
    special = set(getattr(tokenizer, "all_special_ids", ()) or ())
    special |= {i for i, t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items()
                if getattr(t, "special", False)}
    keep = set()
    for marker in fmt.special():
        ids = tokenizer.convert_tokens_to_ids([marker])
        if ids and ids[0] is not None and ids[0] != tokenizer.unk_token_id:
            keep.add(ids[0])
    return frozenset(special - keep)


# --------------------------------------------------------------------------- the KV cache


def default_pool(options, args, max_prompt: int, max_new: int):
    """The server's default KV cache: a page pool of the memory per-row caches would take (batch x
    the pages of each row's cache: `per_row_pages`), so no request ever waits for pages, with
    prefix caching where the target allows it (`--prefix-cache`'s default). `--kv-pages N` sizes it,
    `--kv-pages 0` keeps per-row caches. options: settled for the pair (`resolve`)."""
    from dflash_jax.engine.scheduler import per_row_pages

    pages = per_row_pages(options.batch_size, max_prompt, max_new, options.block_size, options.tree_budget,
                          options.page_size)
    return dataclasses.replace(options, kv_pages=pages, prefix_cache=args.prefix_cache)


def kv_cache_note(gen, default: bool, refused: str | None = None) -> str:
    """The KV cache an engine runs, for the startup log: a pool's pages and whether prompts' pages
    are shared (prefix caching, or why not), or per-row caches (and why)."""
    from dflash_jax.engine.scheduler import prefix_refusal

    spec = gen.spec
    if not spec.kv_pages:
        why = f"the default page pool was refused: {refused}" if refused else "--kv-pages 0"
        return f"per-row caches of {spec.cache_len} positions x {gen.batch_size} slots ({why}); no prefix caching"
    size = (f"the default: the memory of {gen.batch_size} per-row caches of {spec.cache_len} positions"
            if default else "--kv-pages")
    caching = "prefix caching on" if gen.prefix_cache else (
        f"prefix caching off: {prefix_refusal(spec) or '--prefix-cache off'}")
    return f"a page pool of {spec.kv_pages} pages of {spec.page_size} positions ({size}), {caching}"


# --------------------------------------------------------------------------- structured output

def constraint_pool(options, args, pair):
    """The server's structured output: (options with the pool's size, the `ConstraintCache` requests
    compile with, or None and why a constrained request is refused). --constraint-states unset: a
    pool of `engine.constraints.DEFAULT_STATES` per slot (every cycle kind masks its drafts: the chain,
    a draft tree, a DFlash2 drafter's selector, plain decoding); 0: none."""
    import dataclasses

    asked = args.constraint_states
    if asked == 0:
        return options, None, "structured output is off on this server (--constraint-states 0)"
    if pair.tokenizer is None:
        return options, None, "this model has no tokenizer, which constraints compile over"
    from dflash_jax.constrain import ConstraintCache, vocabulary_of

    from dflash_jax.engine.constraints import DEFAULT_STATES

    options = dataclasses.replace(options, constraint_states=asked or DEFAULT_STATES)
    vocab = vocabulary_of(pair.tokenizer, pair.target.vocab_size, pair.stop_tokens)
    return options, ConstraintCache(vocab, max_states=options.constraint_states), None
