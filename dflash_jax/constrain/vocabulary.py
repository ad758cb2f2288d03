"""A target's vocabulary as outlines-core sees it: each token id -> the exact bytes it decodes to.

`vocabulary_of(tokenizer, vocab_size, eos_ids)` reads the tokenizer's own model (its `tokenizer.json`:
the vocab and the decoder), never the hub. Two families of vocabularies:

- byte-level BPE (GPT-2's byte mapping, 'Ġ' for a space; decoder `ByteLevel`): each character of a
  token stands for one byte (the inverse of GPT-2's `bytes_to_unicode`), so a token may be a part of
  a multi-byte UTF-8 character (not valid UTF-8 alone): outlines-core matches bytes, so such tokens
  still spell non-ASCII text, a byte at a time;
- SentencePiece-style ('▁' for a space, decoders `Replace('▁', ' ')` or `Metaspace`; with byte
  fallback, `<0xNN>` tokens are the single byte NN): a token is its text with '▁' -> ' '.
  The `Strip` decoder such tokenizers carry drops one leading space of a whole decoded text; the
  automaton constrains the tokens' bytes, so a constraint whose text may begin with a space can
  decode without it.

Never allowed (left out of the map): the tokenizer's added and special tokens (eos aside, which the
automaton allows in final states itself), ids at or beyond `vocab_size` or beyond the tokenizer
(the embedding's padding rows), and tokens that decode to no bytes.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence
from functools import cached_property

from dflash_jax.errors import InputError

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_decoder() -> dict[str, int]:
    """GPT-2's `bytes_to_unicode`, inverted: the character a byte-level vocabulary writes -> the byte."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars


BYTE_DECODER = _byte_decoder()


@dataclasses.dataclass(frozen=True, eq=False)
class TokenVocabulary:
    """The token ids a constraint may choose from and the bytes each spells (`token_bytes[id]`;
    ids left out are never allowed), the stop ids (`eos_ids`) and the padded `vocab_size`."""
    vocab_size: int
    eos_ids: tuple[int, ...]
    token_bytes: dict[int, bytes]
    level: str  # "byte" | "sentencepiece" | "text": how tokens were read

    @cached_property
    def outlines(self):
        """outlines-core's `Vocabulary` (bytes -> ids; its one eos id is `eos_ids[0]`)."""
        from outlines_core import Vocabulary

        by_bytes: dict[bytes, list[int]] = {}
        for i, b in self.token_bytes.items():
            by_bytes.setdefault(b, []).append(i)
        return Vocabulary(self.eos_ids[0], by_bytes)


def _backend(tokenizer):
    """The `tokenizers.Tokenizer` under a transformers tokenizer (or the tokenizer itself)."""
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    if not hasattr(backend, "to_str"):
        raise InputError(f"vocabulary: {type(tokenizer).__name__} is not a fast (tokenizers) tokenizer; "
                         "constraints need its tokenizer.json")
    return backend


def _decoders(decoder) -> list[dict]:
    if decoder is None:
        return []
    if decoder.get("type") == "Sequence":
        return [d for sub in decoder.get("decoders", []) for d in _decoders(sub)]
    return [decoder]


def _level(decoder) -> tuple[str, str | None]:
    """How the tokens read: ("byte", None), ("sentencepiece", space character) or ("text", None)."""
    kinds = _decoders(decoder)
    types = {d.get("type") for d in kinds}
    if "ByteLevel" in types:
        return "byte", None
    for d in kinds:
        if d.get("type") == "Metaspace":
            return "sentencepiece", d.get("replacement", "▁")
        if d.get("type") == "Replace" and d.get("content") == " ":
            pattern = d.get("pattern", {}).get("String")
            if isinstance(pattern, str) and len(pattern) == 1:
                return "sentencepiece", pattern
    unsupported = types - {"ByteFallback", "Fuse", "Strip", "Replace"}
    if unsupported:
        raise InputError(f"vocabulary: the tokenizer's decoder {sorted(unsupported)} is not supported "
                         "(byte-level BPE and SentencePiece-style vocabularies are)")
    return "text", None


def _token_bytes(token: str, level: str, space: str | None, byte_fallback: bool) -> bytes | None:
    if level == "byte":
        try:
            return bytes(BYTE_DECODER[c] for c in token)
        except KeyError:
            return None
    if byte_fallback:
        m = _BYTE_TOKEN.fullmatch(token)
        if m:
            return bytes([int(m.group(1), 16)])
    if space is not None:
        token = token.replace(space, " ")
    return token.encode("utf-8")


def vocabulary_of(tokenizer, vocab_size: int, eos_ids: Sequence[int]) -> TokenVocabulary:
    """The vocabulary constraints compile over: `tokenizer` (a transformers fast tokenizer or a
    `tokenizers.Tokenizer`), the target's padded `vocab_size` (its embedding's rows) and the ids that
    end a row (`eos_ids`, at least one; each allowed exactly in final states)."""
    eos = tuple(dict.fromkeys(int(i) for i in eos_ids))
    if not eos:
        raise InputError("vocabulary: constraints need at least one eos (stop) token id")
    bad = [i for i in eos if not 0 <= i < vocab_size]
    if bad:
        raise InputError(f"vocabulary: eos id {bad[0]} is outside the vocabulary (size {vocab_size})")
    backend = _backend(tokenizer)
    spec = json.loads(backend.to_str())
    model = spec.get("model") or {}
    vocab = model.get("vocab")
    if isinstance(vocab, list):  # Unigram: [[piece, score], ...]
        vocab = {piece: i for i, (piece, _score) in enumerate(vocab)}
    if not isinstance(vocab, dict):
        raise InputError(f"vocabulary: tokenizer model {model.get('type')!r} has no readable vocab")
    level, space = _level(spec.get("decoder"))
    byte_fallback = bool(model.get("byte_fallback"))
    added = {int(t["id"]) for t in spec.get("added_tokens", [])}
    token_bytes = {}
    for token, i in vocab.items():
        if i >= vocab_size or i in added or i in eos:
            continue
        b = _token_bytes(token, level, space, byte_fallback)
        if b:
            token_bytes[int(i)] = b
    if not token_bytes:
        raise InputError("vocabulary: the tokenizer has no token a constraint could use")
    return TokenVocabulary(vocab_size=int(vocab_size), eos_ids=eos, token_bytes=token_bytes, level=level)
