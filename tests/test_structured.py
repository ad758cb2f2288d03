"""Structured output end to end on the bundled demo pair: a JSON schema compiled on its tokenizer
(`dflash_jax.constrain`) constrains rows on the device (`dflash_jax.engine.constraints`); every
answer is JSON valid against the schema (or cut at its limit), and the chain's tokens equal
constrained plain decoding's, greedy and seeded. Heavy: more schemas and prompts."""

from __future__ import annotations

import functools
import json

import jsonschema
import pytest

from dflash_jax.constrain import Constraint, ConstraintCache, vocabulary_of
from dflash_jax.engine import BatchEngine, Sampling
from bench.constrained import PROMPTS as BENCH_PROMPTS, SCHEMAS  # the bench's schemas and prompts: one home

PROMPTS = BENCH_PROMPTS[:2]


@functools.cache
def demo():
    from dflash_jax.pair import open_pair

    pair = open_pair().open_tokenizer().load_weights()
    cache = ConstraintCache(vocabulary_of(pair.tokenizer, pair.target.vocab_size, pair.stop_tokens))
    return pair, cache


def run(block_size, rows, prompts, seed=0, batch_size=4, tree_budget=0):
    pair, _ = demo()
    gen = BatchEngine(pair.target, pair.tparams, pair.drafter if block_size > 1 else None,
                      pair.dparams if block_size > 1 else None, block_size=block_size, batch_size=batch_size,
                      max_new_tokens=96, max_prompt_len=32, sampling=Sampling(per_row=True),
                      stop_token_ids=pair.stop_tokens, speculation="fixed", constraint_states=512,
                      tree_budget=tree_budget)
    ids = [pair.tokenizer.encode(p) for p in prompts]
    return sorted(gen.generate(ids, seed=seed, sampling=rows), key=lambda r: r.index)


def check(results, schemas):
    pair, _ = demo()
    for r, schema in zip(results, schemas):
        text = pair.tokenizer.decode(r.output_ids, skip_special_tokens=True)
        if r.finish_reason == "length":  # cut at its limit: a prefix the automaton allows
            continue
        jsonschema.validate(json.loads(text), schema)


# sampled: heavy here, everyday on tiny models (tests/test_constrained.py)
@pytest.mark.parametrize("temperature", [0.0, pytest.param(0.8, marks=pytest.mark.heavy)])
def test_demo_rows_answer_valid_json_and_equal_constrained_plain_decoding(temperature):
    _, cache = demo()
    schemas = [SCHEMAS[0], SCHEMAS[1], SCHEMAS[1], SCHEMAS[0]]
    rows = [Sampling(temperature, per_row=True, constraint=cache.get(Constraint.json_schema(s))) for s in schemas]
    prompts = PROMPTS * 2
    spec = run(16, rows, prompts, seed=5)
    plain = run(1, rows, prompts, seed=5)
    assert [r.output_ids for r in spec] == [r.output_ids for r in plain]
    check(spec, schemas)
    assert sum(r.finish_reason == "stop" for r in spec) >= 3  # most answers complete within the limit


def test_rows_of_python_m_infer_carry_their_constraints(tmp_path):
    """`python -m infer` rows take the server's constraint fields: a row's response_format and
    structured_outputs answer as the server would (valid JSON, a regex's match), a row without one is
    free; a row whose constraint is refused is an error row naming it, the others run."""
    from infer.cli import EXIT_ROW_ERRORS, main

    rows = [{"id": "schema", "prompt": PROMPTS[0],
             "response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMAS[1]}}},
            {"id": "regex", "prompt": PROMPTS[1], "structured_outputs": {"regex": "[0-9]{2,4}-[a-c]{1,3}"}},
            {"id": "free", "prompt": PROMPTS[1]},
            {"id": "huge", "prompt": PROMPTS[0], "structured_outputs": {"regex": "x{600}"}},
            {"id": "bias", "prompt": PROMPTS[1], "logit_bias": {"300": 100}, "max_new_tokens": 5}]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code = main(["--input", str(src), "--output", str(out), "--max-new-tokens", "96", "--batch-size", "4",
                 "--speculation", "fixed", "--quiet"])
    assert code == EXIT_ROW_ERRORS
    got = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    jsonschema.validate(json.loads(got["schema"]["text"]), SCHEMAS[1])
    import re

    assert re.fullmatch("[0-9]{2,4}-[a-c]{1,3}", got["regex"]["text"]), got["regex"]["text"]
    assert "text" in got["free"] and "error" not in got["free"]
    pair, _ = demo()
    assert got["bias"]["text"] == pair.tokenizer.decode([300] * 5, skip_special_tokens=True)  # +100: only it
    assert "601 states" in got["huge"]["error"] and "512" in got["huge"]["error"], got["huge"]["error"]


GOAL_SCHEMAS = SCHEMAS + [
    {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "object", "properties": {
        "id": {"type": "integer"}, "price": {"type": "number"}}, "required": ["id", "price"]}, "maxItems": 3}},
     "required": ["items"]},
    {"type": "object", "properties": {"quote": {"type": "string", "maxLength": 20}}, "required": ["quote"]},
    {"type": "object", "properties": {"level": {"enum": ["low", "mid", "high"]}, "on": {"type": "boolean"},
                                      "note": {"type": ["string", "null"], "maxLength": 8}},
     "required": ["level", "on", "note"]},
    {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 6},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
        "c": {"type": "string", "maxLength": 6}}, "required": ["c"]}}, "required": ["b"]}}, "required": ["a"]},
    {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"},
                                      "label": {"type": "string", "pattern": "^[a-z]{1,5}$"}},
     "required": ["x", "y", "label"]},
]
GOAL_PROMPTS = PROMPTS + ["Return the config as JSON.\n", "# data\n", "{\"", "result = ", "Answer:", "[1, 2"]


def goal_cases(temperature):
    _, cache = demo()
    cases = [(s, p) for s in GOAL_SCHEMAS for p in GOAL_PROMPTS]
    rows = [Sampling(temperature, per_row=True, constraint=cache.get(Constraint.json_schema(s))) for s, _ in cases]
    return cases, rows, [p for _, p in cases]


@functools.cache
def goal_plain(temperature):
    """Constrained plain decoding's answers to the goal matrix (shared by the chain and the tree)."""
    _, rows, prompts = goal_cases(temperature)
    return [r.output_ids for r in run(1, rows, prompts, seed=11, batch_size=16)]


@pytest.mark.heavy
@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("tree", [0, 16])
def test_every_constrained_answer_validates_8_schemas_by_8_prompts(temperature, tree):
    """The issue's goal matrix, the chain and a draft tree: 8 schemas x 8 prompts, each answer that ends
    "stop" valid against its schema (one cut at its limit is a prefix the automaton allows), every answer
    equal to constrained plain decoding's."""
    cases, rows, prompts = goal_cases(temperature)
    spec = run(16, rows, prompts, seed=11, batch_size=16, tree_budget=tree)
    assert [r.output_ids for r in spec] == goal_plain(temperature)
    check(spec, [s for s, _ in cases])
    complete = sum(r.finish_reason == "stop" for r in spec)
    assert complete >= len(cases) * 3 // 4, complete
