"""A choice's logprobs in OpenAI's two shapes, from the engine's (`Result.logprobs`, `top_logprobs`,
or a streamed chunk's): each token's logprob under the target's raw distribution and its top
alternatives (token id, logprob), most likely first.

    chat         {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}
    completions  {"tokens", "token_logprobs", "top_logprobs": [{token: logprob}] (null entries for
                 logprobs 0), "text_offset"}

A token's string is the tokenizer's decode of its one id (special tokens kept) and its bytes the
token's own UTF-8 bytes (a byte-level token that is half a character has its raw bytes, not the
replacement character's): `ServedModel.token_piece`. A logprob of float32's -inf is sent as -9999.0
(JSON has no infinity), as vLLM does.
"""

from __future__ import annotations

FLOOR = -9999.0


def _value(logprob: float) -> float:
    return max(float(logprob), FLOOR)


def chat_logprobs(model, ids: list[int], logprobs: list[tuple[float, list[tuple[int, float]]]]) -> dict:
    """A chat choice's (or chunk's) `logprobs`: {"content": [...]} for tokens ids, each with
    (own logprob, top alternatives)."""
    def entry(token_id, logprob):
        text, raw = model.token_piece(token_id)
        return {"token": text, "logprob": _value(logprob), "bytes": raw}

    return {"content": [{**entry(t, own), "top_logprobs": [entry(i, x) for i, x in top]}
                        for t, (own, top) in zip(ids, logprobs)]}


def completion_logprobs(model, ids: list[int], logprobs: list[tuple[float, list[tuple[int, float]]]], offset: int,
                        alternatives: int) -> tuple[dict, int]:
    """A completion choice's (or chunk's) `logprobs` for tokens ids, their text offsets counted from
    offset (the characters of the choice's earlier tokens); returns it and the offset after them.
    alternatives: the request's logprobs (0: top_logprobs entries are null)."""
    tokens, own, tops, offsets = [], [], [], []
    for t, (lp, top) in zip(ids, logprobs):
        text = model.token_piece(t)[0]
        tokens.append(text)
        own.append(_value(lp))
        tops.append({model.token_piece(i)[0]: _value(x) for i, x in top} if alternatives else None)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": own, "top_logprobs": tops, "text_offset": offsets}, offset


def token_piece(tokenizer, token_id: int) -> tuple[str, list[int]]:
    """(the token's string, its UTF-8 bytes) by a tokenizer (None: "token_id:N", as vLLM names ids)."""
    if tokenizer is None:
        text = f"token_id:{token_id}"
        return text, list(text.encode())
    text = tokenizer.decode([token_id], skip_special_tokens=False)
    raw = text.encode("utf-8")
    if "\ufffd" in text:  # half a character: the token's own bytes, where its vocabulary spells them
        raw = _raw_bytes(tokenizer.convert_ids_to_tokens(token_id)) or raw
    return text, list(raw)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte (the inverse of its bytes_to_unicode)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_BYTES = _byte_decoder()


def _raw_bytes(piece) -> bytes | None:
    """A vocabulary entry's bytes: a byte-level BPE token's (GPT-2's alphabet) or a SentencePiece
    byte token's ("<0xE2>"); None for any other."""
    if not isinstance(piece, str) or not piece:
        return None
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return bytes([int(piece[3:5], 16)])
        except ValueError:
            return None
    if all(c in _BYTES for c in piece):
        return bytes(_BYTES[c] for c in piece)
    return None
