"""A request's answer as it comes from the engine: its tokens turned into text and released as
they grow (`StreamedText`: stop strings and stop token ids end it, text that may begin a stop string
or is half a UTF-8 character is held back), and the two ways it reaches the client: gathered
into one response (`collect`) or sent as server-sent events (`event_stream`, ending in
`data: [DONE]`).

A request of n choices runs n rows. The engine delivers (choice, tokens, result, logprobs) on one
asyncio queue (`submit` in `infer.serve.handlers`); `result` is None until that choice's row has
ended, `logprobs` those tokens' where the request asked (`infer.serve.logprobs` shapes them).
`decoded` is then a list: each choice's `StreamedText`.
"""

from __future__ import annotations

import asyncio
import json
import time

from infer.serve.logprobs import chat_logprobs, completion_logprobs
from infer.serve.protocol import APIError, AssistantMessage, Choice, Completion, Usage, dump


class StreamedText:
    """A row's tokens as text, released as it grows: stop strings cut it (the row ends there)
    and text that may be the start of a stop string, or half a character, is held back.
    `model`: what decodes ids (`ServedModel.decode`); `request`: its `stop` and `stop_ids`.

    `text` is always `model.decode(ids)` (up to a stop string's cut), kept incrementally: the text
    of a prefix of the ids is settled, and each delivery decodes only the new ids and the few settled
    ones before them (`WINDOW`), whose own text is then taken off the front. Where that window's
    text is not a prefix of the longer decode (a tokenizer whose decode joins across tokens, a
    character still half), the whole is decoded instead, as it always was."""

    WINDOW = 4  # settled tokens decoded again before the new ones (their context: a leading space, a byte)

    def __init__(self, model, request):
        self.model, self.request = model, request
        tools = getattr(request, "tools", None)
        # An answer read for tool calls keeps the format's markers that are special tokens.
        self.decode = (lambda ids: model.decode(ids, keep_markers=True)) if tools is not None and tools.parses \
            else model.decode
        self.ids: list[int] = []
        self.logprobs: list = []  # where asked: each id's (logprob, top alternatives), cut with the ids
        self.offset = 0  # a completion's logprobs: the characters of the tokens already sent (text_offset)
        self.text, self.released = "", 0
        self.stopped = False  # a stop string or a request's stop token ended it
        self.hold = max((len(s) for s in request.stop), default=1) - 1
        # decode(ids[:settled]) is settled_text; window_text is decode(ids[settled - WINDOW:settled]).
        self._settled, self._settled_text, self._window_text = 0, "", ""

    def _text_of(self, k: int) -> str:
        """decode(ids[:k]), for k at or past the settled ids, decoding only from the window on."""
        start = max(0, self._settled - self.WINDOW)
        if start == 0:
            return self.decode(self.ids[:k])
        tail = self.decode(self.ids[start:k])
        if tail.startswith(self._window_text):
            return self._settled_text + tail[len(self._window_text):]
        return self.decode(self.ids[:k])

    def _settle(self) -> None:
        """The ids' text so far is final unless it ends in half a character (the next ids may complete it)."""
        if self.text.endswith("\ufffd") or len(self.ids) <= self.WINDOW:
            return
        window = self.decode(self.ids[len(self.ids) - self.WINDOW:])
        if window:  # (a window of special tokens alone would say nothing of the text before it)
            self._settled, self._settled_text, self._window_text = len(self.ids), self.text, window

    def add(self, tokens: list[int], logprobs=None) -> None:
        """A delivery's tokens (and, where asked, their (logprobs, top_logprobs) as the engine emits them)."""
        if self.stopped:
            return
        if logprobs is not None:
            self.logprobs += list(zip(*logprobs))
        try:
            self._add(tokens)
        finally:
            del self.logprobs[len(self.ids):]

    def _add(self, tokens: list[int]) -> None:
        for j, t in enumerate(tokens):
            if t in self.request.stop_ids:
                tokens, self.stopped = tokens[:j + 1], True
                break
        before = len(self.ids)
        self.ids += tokens
        self.text = self._text_of(len(self.ids))
        cut = self._stop_at(self.text)
        if cut is not None:
            # The row ends with the token that completed the stop string: later ones are dropped
            # (from the ids and the usage too), and the text ends before the stop string.
            for k in range(before + 1, len(self.ids) + 1):
                if self._stop_at(self._text_of(k)) is not None:
                    self.ids = self.ids[:k]
                    break
            self.text, self.stopped = self.text[:cut], True
            return
        self._settle()

    def _stop_at(self, text: str) -> int | None:
        """Where the earliest stop string starts in text (None: nowhere); text already released
        holds none, so the search starts just before it."""
        found = [at for s in self.request.stop if (at := text.find(s, max(0, self.released - len(s)))) >= 0]
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


def finish_reason(decoded: StreamedText, result) -> str:
    """A whole answer's finish reason (a row `cut_short` is answered with an error instead)."""
    return "stop" if decoded.stopped or result.finish_reason == "stop" else "length"


ENGINE_FAILED = "the engine failed; see the server's log"
SHUT_DOWN = "the server is shutting down and cancelled this request before its answer was complete; retry it"


def cut_short(decoded: StreamedText, result) -> APIError | None:
    """The error a row's answer is, where the server ended the row before the answer was whole:
    the engine failed (500), or shutting down cancelled it (503). None for a whole answer (its
    own end, max_tokens, or a stop string found before the cut)."""
    if decoded.stopped or result.finish_reason in ("stop", "length"):
        return None
    if result.finish_reason == "cancelled":
        return APIError(503, SHUT_DOWN, type="server_error", code="unavailable")
    return APIError(500, ENGINE_FAILED, type="server_error")


def usage(request, decoded: list[StreamedText]) -> Usage:
    """The prompt counts once, whatever n; the completion tokens are every choice's."""
    n, prompt = sum(len(d.ids) for d in decoded), len(request.prompt_ids)
    return Usage(prompt_tokens=prompt, completion_tokens=n, total_tokens=prompt + n)



def _deliver(engine_requests, decoded: list[StreamedText], results: list, delivery) -> tuple[int, int]:
    """Add one delivery (choice, tokens, result) to its choice; a stop string or stop id ends the
    row at the engine's next sync. Returns (the choice, its token count before)."""
    i, tokens, result, logprobs = delivery
    was = len(decoded[i].ids)
    decoded[i].add(tokens, logprobs)
    if decoded[i].stopped and result is None:
        engine_requests[i].stopped = engine_requests[i].cancelled = True  # ends as "stop" at the engine's next sync
    results[i] = result
    return i, was


def _cancel_unfinished(engine_requests, results: list) -> None:
    for engine_request, result in zip(engine_requests, results):
        if result is None:
            engine_request.cancelled = True  # the client went away (or the server is stopping): free the slot


async def collect(http_request, engine_requests, events: asyncio.Queue, decoded: list[StreamedText]):
    """Wait for every choice's row to end, adding its tokens to its `decoded`; the engine's Results,
    or None when the client went away (its rows are then cancelled). A row the server cut raises
    its `cut_short` error."""
    results: list = [None] * len(engine_requests)
    try:
        while any(r is None for r in results):
            try:
                delivery = await asyncio.wait_for(events.get(), timeout=1.0)
            except asyncio.TimeoutError:
                if await http_request.is_disconnected():
                    return None  # the client went away: its slots are freed at the next sync
                continue
            _deliver(engine_requests, decoded, results, delivery)
    finally:
        _cancel_unfinished(engine_requests, results)
    errors = [e for d, r in zip(decoded, results) if (e := cut_short(d, r)) is not None]
    if errors:
        raise max(errors, key=lambda e: e.status == 500)  # an engine failure says the most
    return results


def response(request, decoded: list[StreamedText], results, ident: str, model_name: str) -> dict:
    """The whole answer of a request not streamed: a choice per row, in order. A chat answer read
    for tool calls has them as its message's `tool_calls`, and finish_reason "tool_calls"."""
    choices = []
    for i, (d, result) in enumerate(zip(decoded, results)):
        choice = Choice(index=i, finish_reason=finish_reason(d, result), logprobs=_logprobs(request, d, 0))
        if request.chat and request.tools is not None and request.tools.parses:
            content, calls = request.tools.reader().parse(d.text)
            choice.message = AssistantMessage(role="assistant", content=content)
            if calls:
                choice.message.tool_calls = [c.openai() for c in calls]
                choice.finish_reason = "tool_calls"
        elif request.chat:
            choice.message = AssistantMessage(role="assistant", content=d.text)
        else:
            choice.text = d.text
        if request.return_token_ids:
            choice.token_ids = d.ids
        choices.append(choice)
    return dump(Completion(id=ident, object="chat.completion" if request.chat else "text_completion",
                           created=int(time.time()), model=model_name, choices=choices,
                           usage=usage(request, decoded)))


def _logprobs(request, decoded: StreamedText, was: int) -> dict | None:
    """The logprobs of a choice's tokens from was on, in the endpoint's shape (None: not asked)."""
    asked = request.sampling.logprobs
    if asked is None:
        return None
    ids, entries = decoded.ids[was:], decoded.logprobs[was:]
    if request.chat:
        return chat_logprobs(decoded.model, ids, entries)
    out, decoded.offset = completion_logprobs(decoded.model, ids, entries, decoded.offset, asked)
    return out


class _Chunks:
    """The data lines of one stream: every chunk carries the stream's id, object and time."""

    def __init__(self, request, ident: str, model_name: str):
        self.request, self.ident, self.model_name = request, ident, model_name
        self.kind = "chat.completion.chunk" if request.chat else "text_completion"
        self.created = int(time.time())

    def _line(self, body: Completion) -> str:
        return f"data: {json.dumps(dump(body), ensure_ascii=False)}\n\n"

    def chunk(self, index: int, text: str | None, reason: str | None, ids: list[int] | None = None,
              role: bool = False, tool_calls: list[dict] | None = None, logprobs: dict | None = None) -> str:
        choice = Choice(index=index, finish_reason=reason, logprobs=logprobs)
        if self.request.chat:
            delta = AssistantMessage(role="assistant") if role else AssistantMessage()
            if text is not None:
                delta.content = text
            if tool_calls is not None:
                delta.tool_calls = tool_calls
            choice.delta = delta
        else:
            choice.text = text or ""
        if ids is not None and self.request.return_token_ids:
            choice.token_ids = ids
        body = Completion(id=self.ident, object=self.kind, created=self.created, model=self.model_name,
                          choices=[choice])
        if self.request.include_usage:
            body.usage = None
        return self._line(body)

    def read(self, reader, index: int, text: str, reason: str | None, ids: list[int] | None,
             logprobs: dict | None = None) -> list[str]:
        """A delivery of an answer read for tool calls (`ToolReader`): a chunk per delta (content, or a
        call's), the delivery's ids (and their logprobs) on the first, the finish reason on the last
        ("tool_calls" where the answer had calls)."""
        deltas = reader.feed(text) + (reader.finish() if reason is not None else [])
        if reason is not None and reader.called:
            reason = "tool_calls"
        if not deltas:
            return [self.chunk(index, None, reason, ids, logprobs=logprobs)] if reason is not None or ids else []
        return [self.chunk(index, d.get("content"), reason if k == len(deltas) - 1 else None, ids if k == 0 else None,
                           tool_calls=d.get("tool_calls"), logprobs=logprobs if k == 0 else None)
                for k, d in enumerate(deltas)]

    def usage(self, decoded: list[StreamedText]) -> str:
        return self._line(Completion(id=self.ident, object=self.kind, created=self.created, model=self.model_name,
                                     choices=[], usage=usage(self.request, decoded)))


async def event_stream(request, engine_requests, events: asyncio.Queue, decoded: list[StreamedText], ident: str,
                       model_name: str):
    """The server-sent events of a streamed request: a chunk at each delivery of a choice's tokens
    (its index in the chunk; text held back as `StreamedText` says), the finish reason on each
    choice's last, usage if asked for, then `data: [DONE]`. A row the server cut (an engine
    failure, or shutting down) ends it with an error event, `data: {"error": {...}}`, and no
    `[DONE]`."""
    chunks = _Chunks(request, ident, model_name)
    results: list = [None] * len(engine_requests)
    tools = request.tools if request.chat and request.tools is not None and request.tools.parses else None
    readers = [tools.reader() for _ in engine_requests] if tools is not None else None
    try:
        if request.chat:
            for i in range(len(engine_requests)):
                yield chunks.chunk(i, "", None, role=True)
        while any(r is None for r in results):
            i, was = _deliver(engine_requests, decoded, results, await events.get())
            result = results[i]
            text = decoded[i].delta(final=result is not None)
            new_ids = decoded[i].ids[was:]
            logprobs = _logprobs(request, decoded[i], was) if new_ids else None
            if result is not None:
                error = cut_short(decoded[i], result)
                if error is not None:  # the answer was cut: the stream says so, and ends without [DONE]
                    yield f"data: {json.dumps(error.body())}\n\n"
                    return
            if readers is not None:
                reason = None if result is None else finish_reason(decoded[i], result)
                for line in chunks.read(readers[i], i, text, reason, new_ids, logprobs):
                    yield line
            elif result is not None:
                yield chunks.chunk(i, text, finish_reason(decoded[i], result), new_ids, logprobs=logprobs)
            elif text or new_ids:
                yield chunks.chunk(i, text, None, new_ids, logprobs=logprobs)
        if request.include_usage:
            yield chunks.usage(decoded)
        yield "data: [DONE]\n\n"
    finally:
        _cancel_unfinished(engine_requests, results)
