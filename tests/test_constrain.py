"""Structured output's host side (dflash_jax/constrain): constraints compiled to token automata.

Against outlines-core's own Index (allowed sets, next states, final states, along seeded random
walks), walks completed to eos checked against the constraint itself (re.fullmatch, jsonschema,
json.loads), the vocabulary (byte-level demo, a SentencePiece-style one with byte fallback, padding
and special ids), the refusals and the cache. No jax; the demo vocabulary has 4,096 ids: seconds.
"""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import transformers

import dflash_jax.constrain.cache as cache_mod
from dflash_jax.constrain import Constraint, ConstraintCache, compile_constraint, vocabulary_of
from dflash_jax.constrain.automaton import build_index
from dflash_jax.errors import InputError

DEMO = Path(__file__).resolve().parents[1] / "dflash_jax" / "demo" / "target"
PADDED = 4160  # the demo's 4,096 ids padded: ids 4096.. are embedding rows no token spells
EOS = (2, 0)

SCHEMAS = [
    {"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"}, "score": {"type": "number"},
        "city": {"enum": ["café", "Zürich", "naïve \"q\""]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 3},
        "inner": {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "null"}},
                  "required": ["ok"]}},
     "required": ["name", "age", "city", "inner"]},
    {"type": "array", "items": {"anyOf": [{"type": "integer"}, {"const": "x\\y\n"}]}, "minItems": 1, "maxItems": 4},
    {"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                      "required": ["x", "y"]}},
     "type": "object", "properties": {"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}}, "required": ["a"]},
]
REGEXES = [r"[0-9]{3}-[a-z]+", r"(yes|no)( please)?", r"[A-Z][a-z]*( [A-Z][a-z]*){0,2}\.", r"caf(e|é)+"]


@pytest.fixture(scope="module")
def tok():
    return transformers.AutoTokenizer.from_pretrained(str(DEMO))


@pytest.fixture(scope="module")
def vocab(tok):
    return vocabulary_of(tok, PADDED, EOS)


def _distance_to_final(a):
    """Each state's fewest tokens to a final state (relaxed over all edges at once)."""
    src = np.repeat(np.arange(a.num_states), a.counts)
    dist = np.where(a.final, 0, 1 << 30)
    while True:
        new = dist.copy()
        np.minimum.at(new, src, dist[a.targets] + 1)
        if (new == dist).all():
            return dist
        dist = new


def _walk(a, rng, eos_ids, patience=40):
    """Token ids from the initial state to an eos: random, then (after `patience`) closing the text
    the shortest way; returns the ids without the eos."""
    dist, state, ids = _distance_to_final(a), a.initial, []
    eos = np.array(sorted(eos_ids))
    while True:
        lo, n = int(a.starts[state]), int(a.counts[state])
        toks, dests = a.tokens[lo:lo + n], a.targets[lo:lo + n]
        keep = ~np.isin(toks, eos)
        toks, dests = toks[keep], dests[keep]
        if a.final[state] and (not len(toks) or rng.random() < 0.3 or len(ids) > patience):
            return ids
        if len(ids) > patience:
            near = dist[dests] == dist[dests].min()
            toks, dests = toks[near], dests[near]
        k = rng.integers(len(toks))
        ids.append(int(toks[k]))
        state = int(dests[k])


def _text(vocab, ids) -> str:
    return b"".join(vocab.token_bytes[i] for i in ids).decode("utf-8")


def _check_arrays(a, vocab, real=4096):
    """The contract's invariants, on every state (`real`: the tokenizer's ids; the rest padding)."""
    eos = np.array(sorted(vocab.eos_ids))
    assert a.initial == 0 and a.starts.dtype == np.int32 and a.masks.dtype == np.uint32
    assert a.masks.shape == (a.num_states, -(-vocab.vocab_size // 32))
    assert (a.targets >= 0).all() and (a.targets < a.num_states).all()
    assert (a.counts > 0).all()  # every state allows something (a final one at least eos)
    assert (a.starts == np.concatenate([[0], np.cumsum(a.counts)[:-1]])).all()
    src = np.repeat(np.arange(a.num_states), a.counts)
    assert (np.diff(a.tokens)[np.diff(src) == 0] > 0).all()  # ascending within a state
    bits = np.unpackbits(a.masks.view(np.uint8), axis=1, bitorder="little")[:, :vocab.vocab_size]
    dense = np.zeros_like(bits)
    dense[src, a.tokens] = 1
    assert (bits == dense).all()  # the mask row is exactly the state's edges
    assert (bits[:, eos] == a.final[:, None]).all()  # eos exactly in final states
    is_eos = np.isin(a.tokens, eos)
    assert (a.targets[is_eos] == src[is_eos]).all()  # eos leads back to its state
    assert (a.tokens < real).all()  # no padding id
    assert np.isin(a.tokens[~is_eos], np.fromiter(vocab.token_bytes, int)).all()  # only real tokens


def _check_against_index(a, constraint, vocab, rng, walks=20, steps=60):
    """Along random walks, the arrays' states answer as outlines-core's Index's do."""
    index = build_index(constraint, vocab)
    o_eos = vocab.eos_ids[0]
    for _ in range(walks):
        s, o = a.initial, index.get_initial_state()
        for _ in range(steps):
            assert bool(a.final[s]) == index.is_final_state(o)
            theirs = set(index.get_allowed_tokens(o)) - {o_eos}
            ours = set(a.allowed(s).tolist()) - set(vocab.eos_ids)
            assert ours == theirs
            if not ours:
                break
            t = sorted(ours)[rng.integers(len(ours))]
            s, o = a.next(s, t), index.get_next_state(o, t)
            assert s >= 0 and o is not None


@pytest.mark.parametrize("pattern", REGEXES)
def test_regex_automaton(vocab, tok, pattern):
    c = Constraint.regex(pattern)
    a = compile_constraint(c, vocab)
    _check_arrays(a, vocab)
    rng = np.random.default_rng(0)
    _check_against_index(a, c, vocab, rng)
    for _ in range(20):
        ids = _walk(a, rng, set(vocab.eos_ids))
        assert a.accepts(ids + [EOS[0]]) and a.accepts(ids)
        text = _text(vocab, ids)
        assert re.fullmatch(pattern, text), text
        assert tok.decode(ids) == text


@pytest.mark.parametrize("k", range(len(SCHEMAS)))
def test_schema_automaton(vocab, tok, k):
    schema = SCHEMAS[k]
    c = Constraint.json_schema(schema)
    a = compile_constraint(c, vocab)
    _check_arrays(a, vocab)
    rng = np.random.default_rng(k)
    _check_against_index(a, c, vocab, rng)
    seen_non_ascii = False
    for _ in range(25):
        ids = _walk(a, rng, set(vocab.eos_ids))
        text = _text(vocab, ids)
        assert tok.decode(ids) == text
        jsonschema.validate(json.loads(text), schema)
        seen_non_ascii |= any(ord(ch) > 127 for ch in text)
    if k == 0:
        assert seen_non_ascii  # the enum's non-ASCII values spelled by partial-byte tokens


def test_non_ascii_choice_needs_partial_tokens(vocab):
    """"café" only spells with tokens that are not UTF-8 alone (é = C3 A9 across tokens)."""
    a = compile_constraint(Constraint.json_schema({"enum": ["café"]}), vocab)
    ids = _walk(a, np.random.default_rng(0), set(vocab.eos_ids))
    assert _text(vocab, ids) == '"café"'
    partial = [i for i in ids if not _decodes(vocab.token_bytes[i])]
    assert partial or any(vocab.token_bytes[i] == "é".encode() for i in ids)


def _decodes(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def test_json_object(vocab):
    a = compile_constraint(Constraint.json_object(), vocab)
    _check_arrays(a, vocab)
    rng = np.random.default_rng(1)
    for _ in range(15):
        ids = _walk(a, rng, set(vocab.eos_ids))
        assert isinstance(json.loads(_text(vocab, ids)), dict)


def test_choice(vocab):
    choices = ["yes", "no", "a|b (c)", "no way"]
    a = compile_constraint(Constraint.choice(choices), vocab)
    _check_arrays(a, vocab)
    rng = np.random.default_rng(2)
    seen = {_text(vocab, _walk(a, rng, set(vocab.eos_ids))) for _ in range(40)}
    assert seen <= set(choices) and len(seen) >= 3


def test_vocabulary_ids(vocab, tok):
    """Special ids, eos and padding are not tokens; every token's bytes decode as the tokenizer does."""
    assert vocab.level == "byte" and vocab.eos_ids == EOS
    assert not {0, 1, 2, 3} & set(vocab.token_bytes) and max(vocab.token_bytes) < 4096
    for i in range(4, 4096, 7):
        b = vocab.token_bytes[i]
        if _decodes(b):
            assert tok.decode([i]) == b.decode()


def _sentencepiece_tokenizer():
    """A tiny SentencePiece-style vocabulary ('▁' for a space, <0xNN> byte fallback), written here."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces += ["▁", "a", "b", "c", "f", "e", "▁caf", "caf", "é", "▁a", "{", "}", '"', ":", "1", "2", "▁b"]
    vocab = {p: i for i, p in enumerate(pieces)}
    t = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    t.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                   decoders.Strip(" ", 1, 0)])
    t.add_special_tokens([AddedToken("<unk>", special=True), AddedToken("<s>", special=True),
                          AddedToken("</s>", special=True)])
    return t, vocab


def test_sentencepiece_vocabulary():
    t, pieces = _sentencepiece_tokenizer()
    v = vocabulary_of(t, len(pieces) + 9, [pieces["</s>"]])
    assert v.level == "sentencepiece"
    assert v.token_bytes[pieces["<0xC3>"]] == b"\xc3" and v.token_bytes[pieces["▁caf"]] == b" caf"
    assert v.token_bytes[pieces["é"]] == "é".encode()
    assert not {0, 1, 2} & set(v.token_bytes) and max(v.token_bytes) < len(pieces)
    pattern = r"(caf|b)é? a"
    c = Constraint.regex(pattern)
    a = compile_constraint(c, v)
    _check_arrays(a, v, real=len(pieces))
    rng = np.random.default_rng(3)
    _check_against_index(a, c, v, rng)
    texts = set()
    for _ in range(30):
        ids = _walk(a, rng, set(v.eos_ids))
        text = _text(v, ids)
        assert re.fullmatch(pattern, text)
        assert t.decode(ids, skip_special_tokens=False) == text  # no leading space: Strip leaves it
        texts.add(text)
    assert "café a" in texts
    # é reached byte by byte too: the initial state's successors include the <0xC3> path
    s = a.next(a.next(a.initial, pieces["caf"]), pieces["<0xC3>"])
    assert s >= 0 and a.next(s, pieces["<0xA9>"]) >= 0 and a.next(s, pieces["a"]) == -1


@pytest.mark.parametrize("make, words", [
    (lambda: Constraint.json_schema({"$defs": {"n": {"type": "object", "properties": {
        "next": {"$ref": "#/$defs/n"}}}}, "$ref": "#/$defs/n"}), ["recursive $ref", "#/$defs/n"]),
    (lambda: Constraint.json_schema({"type": 5}), ["invalid schema", "'#/type'"]),
    (lambda: Constraint.json_schema("{not json"), ["not JSON"]),
    (lambda: Constraint.json_schema({"type": "integer", "minimum": 3}), ["'minimum'", "not supported"]),
    (lambda: Constraint.json_schema({"properties": {"a": {}}, "anyOf": [{}]}), ["'properties' and 'anyOf'"]),
    (lambda: Constraint.json_schema({"properties": {"a": {}}, "required": ["b"]}), ["required property 'b'"]),
    (lambda: Constraint.choice([]), ["non-empty list"]),
    (lambda: Constraint.choice(["a", 3]), ["every choice is a string"]),
    (lambda: Constraint.regex(5), ["expected a string"]),
])
def test_refused_when_made(make, words):
    with pytest.raises(InputError) as e:
        make()
    message = str(e.value)
    assert "\n" not in message and all(w in message for w in words), message


@pytest.mark.parametrize("constraint, words", [
    (Constraint.regex("(?<=a)b"), ["regex: cannot compile"]),
    (Constraint.regex("(ab"), ["regex: cannot compile"]),
    (Constraint.regex(r"(a)\1"), ["regex: cannot compile"]),
    (Constraint.json_schema({"type": "string", "format": "hostname"}), ["json_schema", "hostname"]),
    (Constraint.regex("[a-z]{40}"), ["41 states", "limit of 30"]),
])
def test_refused_when_compiled(vocab, constraint, words):
    with pytest.raises(InputError) as e:
        compile_constraint(constraint, vocab, max_states=30)
    message = str(e.value)
    assert "\n" not in message and all(w in message for w in words), message


def test_constraint_is_a_canonical_key():
    a = Constraint.json_schema({"type": "object", "properties": {"b": {"type": "integer"}, "a": {}}})
    b = Constraint.json_schema('{"type":  "object", "properties": {"b": {"type": "integer"}, "a": {}}}')
    assert a == b and hash(a) == hash(b) and a.kind == "json_schema"  # the same schema, however spaced
    # properties are written in the schema's order: another order is another constraint
    assert a != Constraint.json_schema({"type": "object", "properties": {"a": {}, "b": {"type": "integer"}}})
    assert Constraint.json_object().text == "" and json.loads(Constraint.choice(["x", "y"]).text) == ["x", "y"]


def test_cache_lru(vocab):
    cache = ConstraintCache(vocab, max_entries=2)
    x, y, z = (Constraint.regex(p) for p in ("x+", "y+", "z+"))
    ax = cache.get(x)
    assert cache.get(x) is ax
    cache.get(y)
    cache.get(x)  # x is now the most recent: z evicts y
    cache.get(z)
    assert x in cache and z in cache and y not in cache and len(cache) == 2
    assert cache.get(x) is ax and (cache.hits, cache.misses) == (3, 3)
    one = ax.nbytes
    small = ConstraintCache(vocab, max_bytes=one + one // 2)
    small.get(x)
    small.get(y)  # both would be over max_bytes: the older goes
    assert y in small and x not in small and small.nbytes == small.get(y).nbytes <= one + one // 2


def test_cache_threads(vocab, monkeypatch):
    """Threads asking for the same constraints at once: each compiled once, all get the same object."""
    calls, real = [], cache_mod.compile_constraint

    def slow(c, v, m):
        calls.append(c)
        time.sleep(0.05)
        return real(c, v, m)

    monkeypatch.setattr(cache_mod, "compile_constraint", slow)
    cache = ConstraintCache(vocab)
    keys = [Constraint.regex(p) for p in ("[ab]+", "[cd]+", "[ef]+")]
    results: list = [None] * 24
    bad = Constraint.regex("(?<=a)")
    errors = []

    def work(i):
        results[i] = cache.get(keys[i % 3])
        try:
            cache.get(bad)
        except InputError as e:
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(24)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert sorted(calls, key=str).count(keys[0]) == 1 and len([c for c in calls if c in keys]) == 3
    for i, r in enumerate(results):
        assert r is cache.get(keys[i % 3])
    assert len(errors) == 24 and bad not in cache


@pytest.mark.parametrize("make,says", [
    (lambda: Constraint.regex("a{2000}"), "repetition count of 2000 is more than 1024"),
    (lambda: Constraint.regex("a{3,5000}"), "repetition count of 5000"),
    (lambda: Constraint.regex("x" * 70000), "70000 characters is more than 65536"),
    (lambda: Constraint.json_schema({"type": "string", "maxLength": 100000}), "maxLength 100000 at '#'"),
    (lambda: Constraint.json_schema({"type": "object", "properties": {"a": {"type": "array", "maxItems": 5000}}}),
     "maxItems 5000 at '#/properties/a'"),
    (lambda: Constraint.choice(["y" * 40000, "z" * 40000]), "characters is more than 65536"),
])
def test_sizes_are_bounded_before_anything_compiles(make, says):
    """A constraint whose compile could run away (a huge count, a huge text) is refused when made, in
    microseconds, before outlines-core builds anything."""
    with pytest.raises(InputError, match=re.escape(says)):
        make()
