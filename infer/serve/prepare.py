"""An OpenAI request, validated by its pydantic model, turned into what the engine runs: the
prompt's token ids, max_tokens, the row's sampling and random stream, and how the answer is
shaped (stop strings and ids, streaming, usage, token ids).

What pydantic cannot know is checked here: the model's name, the fields the server does not
support (best_of > 1, logprobs, echo, suffix, several prompts), n's limit, the server's
max_tokens limit, and the engine's own refusal (a prompt longer than the context, a token outside the
vocabulary). Each is an `APIError` in OpenAI's schema.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass, field
from typing import Any

from infer.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest, parse_request


@dataclass
class PreparedRequest:
    """A request, checked and encoded: what the engine runs and how its answer is shaped."""

    chat: bool
    prompt_ids: list[int]
    max_tokens: int
    sampling: Any  # dflash_jax.engine.Sampling, per row
    row_id: int  # keys the row's random stream
    stop: list[str] = field(default_factory=list)
    stop_ids: set[int] = field(default_factory=set)
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False
    n: int = 1  # choices: rows of the same prompt, each its own random stream (`choice_row_ids`)

    def choice_row_ids(self) -> list[int]:
        """The row id (random stream) of each of the n choices. Choice 0's is the request's, so a
        seeded request's first choice is the same whatever n; the others are derived from it."""
        return [self.row_id] + [int.from_bytes(hashlib.blake2b(f"{self.row_id}:{i}".encode(), digest_size=4).digest(),
                                               "little") for i in range(1, self.n)]


MAX_N = 64  # choices per request: each is a row of the batch, so more would only queue


def prepare_request(model, body: Any, chat: bool) -> PreparedRequest:
    """`body`: a request's model (as FastAPI validated it) or its decoded JSON; `model`: the
    `ServedModel` (its name, max_new, encode/chat and engine.check)."""
    from dflash_jax.engine import Sampling

    if not isinstance(body, (CompletionRequest, ChatCompletionRequest)):
        body = parse_request(body, chat)
    _refuse_unsupported(model, body, chat)
    prompt_ids = _chat_prompt(model, body) if chat else _completion_prompt(model, body)
    top = model.max_new
    tokens = body.max_completion_tokens if chat and body.max_completion_tokens is not None else body.max_tokens
    max_tokens = top if tokens is None else tokens
    if max_tokens > top:
        raise APIError(400, f"max_tokens {max_tokens} is more than this server's limit ({top}, its "
                            f"--max-new-tokens)", "max_tokens")
    temperature = 1.0 if body.temperature is None else float(body.temperature)
    top_p = 1.0 if body.top_p is None else float(body.top_p)
    top_k = body.top_k if body.top_k and body.top_k > 0 else 0
    # A seed keys the row's random stream (taken modulo 2**32): the same request with the same
    # seed gets the same tokens, alone or among others. Without one, a fresh stream.
    row_id = body.seed % 2**32 if body.seed is not None else secrets.randbits(32)
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    stream = bool(body.stream)
    prepared = PreparedRequest(
        chat=chat, prompt_ids=prompt_ids, max_tokens=max_tokens,
        sampling=Sampling(temperature, top_k, top_p, per_row=True), row_id=row_id, stop=stop,
        stop_ids=set(body.stop_token_ids or []), stream=stream,
        include_usage=stream and bool(body.stream_options and body.stream_options.include_usage),
        return_token_ids=bool(body.return_token_ids), n=body.n or 1)
    why = model.engine.check(prepared.prompt_ids, prepared.max_tokens)
    if why:
        raise APIError(400, why, "messages" if chat else "prompt", code="context_length_exceeded"
                       if "longer than the context" in why else None)
    return prepared


def _refuse_unsupported(model, body, chat: bool) -> None:
    if body.model is not None and body.model != model.name:
        raise APIError(404, f"the model '{body.model}' does not exist; this server serves '{model.name}'", "model",
                       code="model_not_found")
    if body.n is not None and body.n > MAX_N:
        raise APIError(400, f"n {body.n} is more than this server's limit ({MAX_N} choices per request)", "n")
    if not chat and body.best_of not in (None, 1):
        raise APIError(400, "only best_of = 1 is supported", "best_of")
    if body.logprobs not in (None, False) or (chat and body.top_logprobs is not None):
        raise APIError(400, "logprobs are not supported", "logprobs")
    if not chat and body.echo:
        raise APIError(400, "echo is not supported", "echo")
    if not chat and body.suffix is not None:
        raise APIError(400, "suffix is not supported", "suffix")


def _completion_prompt(model, body: CompletionRequest) -> list[int]:
    prompt = body.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        raise APIError(400, "send one prompt per request (a list of prompts is not supported)", "prompt")
    return model.encode(prompt)


def _chat_prompt(model, body: ChatCompletionRequest) -> list[int]:
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    return model.chat(messages, dict(body.chat_template_kwargs or {}))
