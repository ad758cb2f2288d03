"""An OpenAI request, validated by its pydantic model, turned into what the engine runs: the
prompt's token ids, max_tokens, the row's sampling and random stream, and how the answer is
shaped (stop strings and ids, streaming, usage, token ids).

What pydantic cannot know is checked here, cheapest first, before the prompt is tokenized: the
model's name, every field beyond the model's own (`NOT_DONE`: a field the server knows but does
not do is accepted at its no-op value and refused otherwise; any other field is unknown), the
bounds (`n`, `max_tokens`, the sampling settings' as `dflash_jax.engine.sampling` sets them, `stop`,
`stop_token_ids`, `messages`), the chat messages' roles and fields, the chat template's variables
(`TEMPLATE_VARIABLES`), a request's tools, tool_choice and tool messages
(`infer.serve.toolcalls.request`) and a request's own template (only with --trust-request-chat-template);
then the engine's own refusal (a prompt longer than the context, a token outside the vocabulary).
Each is an `APIError` in OpenAI's schema, 400 naming the field.
"""

from __future__ import annotations

import dataclasses

import difflib
import hashlib
import json
import math
import secrets
from dataclasses import dataclass, field
from typing import Any

from infer.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest, parse_request
from dflash_jax.constrain.fields import GRAMMAR_REFUSAL
from infer.serve.structured import constrained_sampling, request_constraint
from infer.serve.toolcalls.request import plan_tools, tool_messages


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
    tools: Any = None  # a chat request's tools (infer.serve.toolcalls.request.ToolPlan), or None

    def choice_row_ids(self) -> list[int]:
        """The row id (random stream) of each of the n choices. Choice 0's is the request's, so a
        seeded request's first choice is the same whatever n; the others are derived from it."""
        return [self.row_id] + [int.from_bytes(hashlib.blake2b(f"{self.row_id}:{i}".encode(), digest_size=4).digest(),
                                               "little") for i in range(1, self.n)]


# --------------------------------------------------------------------------- bounds

MAX_N = 64  # choices per request: each is a row of the batch, so more would only queue
MAX_STOP = 16  # stop strings per request: each is searched for in the text at every delivery
MAX_STOP_CHARS = 256  # characters per stop string: a stream holds back that many minus one
MAX_STOP_TOKEN_IDS = 128
MAX_MESSAGES = 2048  # chat messages per request
MAX_MODEL_CHARS = 256  # the `model` name a request may send (another name is a 404 that quotes it)
MAX_TEMPLATE_VALUE_CHARS = 256  # a chat template variable's string value

# --------------------------------------------------------------------------- the fields

# A field the server knows (OpenAI's or vLLM's) but does not do: (the endpoints it belongs to,
# its no-op values, why any other value is refused). A no-op value asks for nothing the server
# does not do, so it is accepted (OpenAI's and vLLM's clients send some of them); a type among
# the values accepts any value of that type. Fields the request models declare are done; a field
# neither declared nor here is unknown, refused with a hint where it looks like a known one.
BOTH, CHAT, COMPLETIONS = ("chat", "completions"), ("chat",), ("completions",)
NOT_DONE: dict[str, tuple[tuple[str, ...], tuple, str]] = {
    "best_of": (BOTH, (None, 1), "only best_of = 1 is supported"),
    "echo": (BOTH, (None, False), "echo is not supported"),
    "suffix": (COMPLETIONS, (None,), "suffix is not supported"),
    "prompt_logprobs": (BOTH, (None,), "prompt_logprobs are not supported (the output's logprobs are)"),
    "max_completion_tokens": (COMPLETIONS, (None,), "max_completion_tokens is a chat field; completions use "
                                                     "max_tokens"),
    "presence_penalty": (BOTH, (None, 0), "presence_penalty is not supported (only 0)"),
    "frequency_penalty": (BOTH, (None, 0), "frequency_penalty is not supported (only 0)"),
    "repetition_penalty": (BOTH, (None, 1), "repetition_penalty is not supported (only 1)"),
    "length_penalty": (BOTH, (None, 1), "length_penalty is not supported (only 1)"),
    "min_p": (BOTH, (None, 0), "min_p is not supported (only 0)"),
    "min_tokens": (BOTH, (None, 0), "min_tokens is not supported (only 0)"),
    "include_stop_str_in_output": (BOTH, (None, False), "include_stop_str_in_output is not supported: the text "
                                                        "ends before the stop string"),
    "ignore_eos": (BOTH, (None, False), "ignore_eos is not supported"),
    "skip_special_tokens": (BOTH, (None, True), "the text always skips special tokens"),
    "spaces_between_special_tokens": (BOTH, (None, True), "spaces_between_special_tokens is not supported"),
    "use_beam_search": (BOTH, (None, False), "beam search is not supported"),
    "truncate_prompt_tokens": (BOTH, (None,), "truncate_prompt_tokens is not supported: a prompt longer than the "
                                              "context is refused"),
    "allowed_token_ids": (BOTH, (None,), "allowed_token_ids is not supported"),
    "bad_words": (BOTH, (None, []), "bad_words is not supported"),
    "return_tokens_as_token_ids": (BOTH, (None, False), "return_tokens_as_token_ids is not supported "
                                                        "(return_token_ids is)"),
    "guided_grammar": (BOTH, (None,), "guided_grammar: " + GRAMMAR_REFUSAL),
    "functions": (CHAT, (None, []), "functions (the deprecated form of function calling) is not supported: send "
                                    "tools"),
    "function_call": (CHAT, (None, "none"), "function_call (the deprecated form of function calling) is not supported: "
                                            "send tool_choice"),
    "reasoning_effort": (CHAT, (None,), "reasoning_effort is not supported here; a chat template that reads it "
                                        "takes it in chat_template_kwargs"),
    "modalities": (CHAT, (None, ["text"]), "only text output is supported: modalities may only be [\"text\"]"),
    "audio": (CHAT, (None,), "audio output is not supported"),
    "prediction": (CHAT, (None,), "predicted outputs are not supported"),
    "web_search_options": (CHAT, (None,), "web search is not supported"),
    "verbosity": (CHAT, (None,), "verbosity is not supported"),
    "add_generation_prompt": (CHAT, (None, True), "the prompt always ends with the assistant's turn opening "
                                                  "(add_generation_prompt may only be true)"),
    "continue_final_message": (CHAT, (None, False), "continue_final_message is not supported"),
    "documents": (CHAT, (None, []), "documents are not supported"),
    "store": (BOTH, (None, False), "store is not supported: the server keeps no completions"),
    "user": (BOTH, (None, str), "user must be a string"),
    "metadata": (BOTH, (None, dict), "metadata must be an object"),
    "service_tier": (BOTH, (None, "auto", "default"), "service_tier may only be \"auto\" or \"default\""),
    "prompt_cache_key": (BOTH, (None, str), "prompt_cache_key must be a string"),
    "prompt_cache_retention": (CHAT, (None,), "prompt_cache_retention is not supported: the server's prefix cache "
                                              "keeps pages by its own policy (least recently used)"),
    "prompt_cache_options": (CHAT, (None,), "prompt_cache_options is not supported"),
    "moderation": (CHAT, (None,), "moderation is not supported"),
    "safety_identifier": (BOTH, (None, str), "safety_identifier must be a string"),
    "priority": (BOTH, (None, 0), "priority is not supported (only 0)"),
}

# A chat message's fields besides role, content, name, tool_calls and tool_call_id, the same way.
MESSAGE_NOT_DONE: dict[str, tuple[tuple, str]] = {
    "function_call": ((None,), "function_call (the deprecated form of tool_calls) is not supported: send tool_calls"),
    "refusal": ((None,), "refusal is not supported"),
}
# stream_options' fields besides include_usage, the same way.
STREAM_OPTIONS_NOT_DONE: dict[str, tuple[tuple, str]] = {
    "continuous_usage_stats": ((None, False), "stream_options.continuous_usage_stats is not supported"),
    "include_obfuscation": ((None, bool), "stream_options.include_obfuscation must be a boolean"),
}
ROLES = ("system", "developer", "user", "assistant", "tool")  # "developer" is rendered as "system"
LEGACY_ROLES = ("function",)  # the deprecated form of "tool"

# The chat template variables a request may set (chat_template_kwargs): variables templates read,
# never the tokenizer's own arguments (padding, max_length, truncation, return_tensors, tokenize,
# ...), which would let a request make the server allocate or return what it cannot serve.
TEMPLATE_VARIABLES = ("enable_thinking", "thinking", "reasoning_effort")

# Names other APIs use for a field: "unknown field 'stop_sequences'; did you mean 'stop'?"
ALIASES = {"stop_sequences": "stop", "max_new_tokens": "max_tokens", "max_length": "max_tokens",
           "num_return_sequences": "n", "random_seed": "seed", "max_output_tokens": "max_tokens"}


def _matches(value, want) -> bool:
    """Whether value is the no-op `want`: equal and of the same kind (0 is not False), or, for a
    type, any value of that type."""
    if isinstance(want, type):
        return isinstance(value, want) and (want is bool or not isinstance(value, bool))
    if want is None or isinstance(want, bool):
        return value is want
    if isinstance(want, (int, float)):
        return isinstance(value, (int, float)) and not isinstance(value, bool) and value == want
    return type(value) is type(want) and value == want


def _unknown(name: str, known, where: str = "", param: str | None = None) -> APIError:
    """400 "unknown field 'x'" (in `where`), with the known field it looks like, if any."""
    hint = ALIASES.get(name) if ALIASES.get(name) in known else None
    hint = hint or next(iter(difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.75)), None)
    return APIError(400, f"unknown field '{_short(name)}'" + (f" in {where}" if where else "")
                    + (f"; did you mean '{hint}'?" if hint else ""), param or _short(name))


def _short(value, limit: int = 40) -> str:
    """A value quoted in an error, cut short."""
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= limit else text[:limit] + "..."


def check_fields(body, chat: bool) -> None:
    """Every field beyond the request model's own: a no-op of `NOT_DONE`'s, or a 400 naming it."""
    endpoint = "chat" if chat else "completions"
    known = set(type(body).model_fields) | {k for k, (where, _, _) in NOT_DONE.items() if endpoint in where}
    for name, value in (body.model_extra or {}).items():
        entry = NOT_DONE.get(name)
        if entry is None:
            raise _unknown(name, known)
        if endpoint not in entry[0]:
            raise APIError(400, f"'{name}' is not a {endpoint} field", name)
        if not any(_matches(value, want) for want in entry[1]):
            raise APIError(400, entry[2], name)
    for name, value in ((body.stream_options and body.stream_options.model_extra) or {}).items():
        entry = STREAM_OPTIONS_NOT_DONE.get(name)
        if entry is None:
            raise _unknown(name, {"include_usage", *STREAM_OPTIONS_NOT_DONE}, "stream_options", "stream_options")
        if not any(_matches(value, want) for want in entry[0]):
            raise APIError(400, entry[1], "stream_options")


# --------------------------------------------------------------------------- the request


def prepare_request(model, body: Any, chat: bool) -> PreparedRequest:
    """`body`: a request's model (as FastAPI validated it) or its decoded JSON; `model`: the
    `ServedModel` (its name, max_new, vocab_size, trust_request_chat_template, encode/chat and
    engine.check)."""
    from dflash_jax.engine import Sampling
    from dflash_jax.engine.sampling import SamplingError, check_sampling

    if not isinstance(body, (CompletionRequest, ChatCompletionRequest)):
        body = parse_request(body, chat)
    if body.model is not None and len(body.model) > MAX_MODEL_CHARS:
        raise APIError(400, f"model names are at most {MAX_MODEL_CHARS} characters", "model")
    if body.model is not None and body.model != model.name:
        raise APIError(404, f"the model '{body.model}' does not exist; this server serves '{model.name}'", "model",
                       code="model_not_found")
    check_fields(body, chat)
    if body.n is not None and body.n > MAX_N:
        raise APIError(400, f"n {_short(str(body.n))} is more than this server's limit ({MAX_N} choices per request)", "n")
    top = model.max_new
    tokens = body.max_completion_tokens if chat and body.max_completion_tokens is not None else body.max_tokens
    max_tokens = top if tokens is None else tokens
    if max_tokens > top:
        raise APIError(400, f"max_tokens {_short(str(max_tokens))} is more than this server's limit ({top}, its "
                            f"--max-new-tokens)", "max_tokens")
    temperature = 1.0 if body.temperature is None else float(body.temperature)
    top_p = 1.0 if body.top_p is None else float(body.top_p)
    top_k = body.top_k if body.top_k and body.top_k > 0 else 0  # 0 or -1: off
    bias = body.logit_bias or {}
    if not all(k.isdigit() and len(k) < 12 and int(k) < model.vocab_size for k in bias):
        raise APIError(400, f"logit_bias must map token ids below {model.vocab_size} (as strings) to numbers",
                       "logit_bias")
    try:
        check_sampling(temperature, top_k, top_p)
        sampling = Sampling(temperature, top_k, top_p, per_row=True,
                            logit_bias=tuple((int(k), v) for k, v in bias.items()))
    except SamplingError as e:
        raise APIError(400, str(e), e.field) from None
    logprobs = _logprobs(body, chat)
    sampling = dataclasses.replace(sampling, logprobs=logprobs)
    # A seed keys the row's random stream (taken modulo 2**32): the same request with the same
    # seed gets the same tokens, alone or among others. Without one, a fresh stream.
    row_id = body.seed % 2**32 if body.seed is not None else secrets.randbits(32)
    stop = _stop(body)
    stop_ids = _stop_ids(body, model.vocab_size)
    tools = None
    if chat:  # a request's own template (a trusting server's) decides whether tools reach the prompt
        template = body.chat_template if body.chat_template is not None else (body.chat_template_kwargs or {}).get(
            "chat_template")
        tools = plan_tools(model, body.tools, body.tool_choice, body.parallel_tool_calls, template)
    found = request_constraint(body, tools)
    if found is not None:  # compiled here, in the request's thread, never on the engine's
        sampling = dataclasses.replace(sampling, constraint=constrained_sampling(model, found))
    prompt_ids = _chat_prompt(model, body, tools) if chat else _completion_prompt(model, body)
    stream = bool(body.stream)
    prepared = PreparedRequest(
        chat=chat, prompt_ids=prompt_ids, max_tokens=max_tokens,
        sampling=sampling, row_id=row_id, stop=stop,
        stop_ids=stop_ids, stream=stream,
        include_usage=stream and bool(body.stream_options and body.stream_options.include_usage),
        return_token_ids=bool(body.return_token_ids), n=body.n or 1, tools=tools)
    why = model.engine.check(prepared.prompt_ids, prepared.max_tokens)
    if why:
        raise APIError(400, why, "messages" if chat else "prompt", code="context_length_exceeded"
                       if "longer than the context" in why else None)
    return prepared


def _logprobs(body, chat: bool) -> int | None:
    """The top alternatives a request's tokens come with (None: no logprobs): chat's logprobs true
    with top_logprobs (0..20, default 0; without logprobs true only 0), completions' logprobs
    (0..20; false: none)."""
    from dflash_jax.engine.sampling import logprobs_problem

    if chat:
        top = body.top_logprobs
        if not body.logprobs:
            if top is None or top == 0 and not isinstance(top, bool):
                return None
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        name, value = "top_logprobs", 0 if top is None else top
    else:
        name, value = "logprobs", None if body.logprobs is False else body.logprobs
    why = logprobs_problem(value)
    if why:
        raise APIError(400, f"{name} {why}", name)
    return value


def _stop(body) -> list[str]:
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > MAX_STOP:
        raise APIError(400, f"stop holds {len(stop)} strings; this server takes at most {MAX_STOP}", "stop")
    if any(len(s) > MAX_STOP_CHARS for s in stop):
        raise APIError(400, f"a stop string is at most {MAX_STOP_CHARS} characters", "stop")
    return stop


def _stop_ids(body, vocab_size: int) -> set[int]:
    ids = body.stop_token_ids or []
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise APIError(400, f"stop_token_ids holds {len(ids)} ids; this server takes at most {MAX_STOP_TOKEN_IDS}",
                       "stop_token_ids")
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise APIError(400, f"stop token id {_short(str(bad))} outside the vocabulary (0..{vocab_size - 1})",
                       "stop_token_ids")
    return set(ids)


def _completion_prompt(model, body: CompletionRequest) -> list[int]:
    prompt = body.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        raise APIError(400, "send one prompt per request (a list of prompts is not supported)", "prompt")
    return model.encode(prompt)


def _chat_prompt(model, body: ChatCompletionRequest, tools) -> list[int]:
    if len(body.messages) > MAX_MESSAGES:
        raise APIError(400, f"messages holds {len(body.messages)} messages; this server takes at most {MAX_MESSAGES}",
                       "messages")
    messages = [_message(i, m) for i, m in enumerate(body.messages)]
    tool_messages(messages, body.messages)
    kwargs = dict(body.chat_template_kwargs or {})
    template = kwargs.pop("chat_template", None)
    if body.chat_template is not None or template is not None:
        param = "chat_template" if body.chat_template is not None else "chat_template_kwargs"
        if not model.trust_request_chat_template:
            raise APIError(400, "a request's chat_template runs on the server, which takes one only when started "
                                "with --trust-request-chat-template", param)
        template = body.chat_template if body.chat_template is not None else template
        if not isinstance(template, str):
            raise APIError(400, "chat_template must be a string", param)
    for name, value in kwargs.items():
        if name not in TEMPLATE_VARIABLES:
            raise APIError(400, f"chat_template_kwargs: '{_short(name)}' is not a chat template variable this server "
                                f"passes (it passes {', '.join(TEMPLATE_VARIABLES)})", "chat_template_kwargs")
        if not _template_value(value):
            raise APIError(400, f"chat_template_kwargs.{name} must be a boolean, a number or a string of at most "
                                f"{MAX_TEMPLATE_VALUE_CHARS} characters", "chat_template_kwargs")
    if tools is not None:
        kwargs["tools"] = tools.tools
    return model.chat(messages, kwargs, template)


def _template_value(value) -> bool:
    if value is None or isinstance(value, bool):
        return True
    if isinstance(value, int):
        return abs(value) < 2**31
    if isinstance(value, float):
        return math.isfinite(value)
    return isinstance(value, str) and len(value) <= MAX_TEMPLATE_VALUE_CHARS


def _message(i: int, m) -> dict:
    """A chat message as the template takes it; 400 naming messages[i] for one it cannot."""
    param = f"messages[{i}]"
    if m.role in LEGACY_ROLES:
        raise APIError(400, f"{param}: {m.role} messages are not supported (the deprecated form of tool messages): "
                            "send role \"tool\"", param)
    if m.role not in ROLES:
        raise APIError(400, f"{param}: role must be one of {', '.join(ROLES)}; got '{_short(m.role)}'", param)
    for name, value in (m.model_extra or {}).items():
        entry = MESSAGE_NOT_DONE.get(name)
        if entry is None:
            raise _unknown(name, set(type(m).model_fields) | set(MESSAGE_NOT_DONE), param, param)
        if not any(_matches(value, want) for want in entry[0]):
            raise APIError(400, f"{param}: {entry[1]}", param)
    if isinstance(m.content, list):
        for j, part in enumerate(m.content):
            for name in part.model_extra or {}:
                raise _unknown(name, set(type(part).model_fields), f"{param}.content[{j}]", param)
    out = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
    if m.name is not None:
        out["name"] = m.name
    return out
