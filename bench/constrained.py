"""Structured output's cost on the demo pair: tau and tokens/s of the same prompts unconstrained,
constrained with masked drafts (the engine), and constrained with the drafter's unmasked argmax
(what a drafter that ignores the constraint would draft). `python bench/constrained.py [--batch 8]
[--temperature 0] [--tree-budget N]` (a draft tree of N nodes instead of the chain: unmasked, its
candidates are the drafter's own, every one a child); prints one line per run. Every answer of a constrained run is checked against
its schema (a failure is an error, not a figure)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"},
                                      "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
     "required": ["name", "age", "tags"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "score": {"type": "number"},
                                      "where": {"type": "object", "properties": {"city": {"enum": ["Paris", "Zürich"]}},
                                                "required": ["city"]}},
     "required": ["ok", "score", "where"]},
]
PROMPTS = ["Write a JSON record for a user: ", "def parse(x):\n    return", "Answer in JSON. Config:",
           "import json\nrecord = "]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--tree-budget", type=int, default=0, help="verify a draft tree of N nodes (default 0: the chain)")
    args = p.parse_args(argv)

    import jax
    import jsonschema
    import numpy as np

    from dflash_jax.constrain import Constraint, ConstraintCache, vocabulary_of
    import jax.numpy as jnp

    from dflash_jax.engine import BatchEngine, Sampling
    from dflash_jax.engine import constraints
    from dflash_jax.engine.cycles import chain, tree
    from dflash_jax.pair import open_pair

    pair = open_pair().open_tokenizer().load_weights()
    cache = ConstraintCache(vocabulary_of(pair.tokenizer, pair.target.vocab_size, pair.stop_tokens))
    n = args.batch
    ids = [pair.tokenizer.encode(PROMPTS[i % len(PROMPTS)]) for i in range(n)]
    schemas = [SCHEMAS[i % len(SCHEMAS)] for i in range(n)]
    automata = [cache.get(Constraint.json_schema(s)) for s in schemas]

    def run(label, constrained):
        gen = BatchEngine(pair.target, pair.tparams, pair.drafter, pair.dparams, block_size=pair.drafter.block_size,
                          batch_size=n, max_new_tokens=args.max_new_tokens, max_prompt_len=32,
                          sampling=Sampling(per_row=True), stop_token_ids=pair.stop_tokens, speculation="fixed",
                          constraint_states=512, tree_budget=args.tree_budget)
        rows = [Sampling(args.temperature, per_row=True, constraint=a if constrained else None) for a in automata]
        gen.warmup([len(x) for x in ids], exact=True)
        start = time.perf_counter()
        results = sorted(gen.generate(ids, seed=0, sampling=rows), key=lambda r: r.index)
        seconds = time.perf_counter() - start
        tokens = sum(len(r.output_ids) for r in results)
        tau = float(np.mean([a for r in results for a in r.acceptance_lengths]))
        valid = 0
        for r, schema in zip(results, schemas):
            if constrained and r.finish_reason == "stop":
                jsonschema.validate(json.loads(pair.tokenizer.decode(r.output_ids, skip_special_tokens=True)), schema)
                valid += 1
        done = f", {valid}/{n} complete and valid" if constrained else ""
        print(f"{label}: tau {tau:.3f}, {tokens / seconds:.1f} tokens/s ({tokens} tokens, {seconds:.2f} s){done}",
              flush=True)

    run("unconstrained", False)
    run("constrained, masked drafts", True)
    chain.masked_argmax = lambda pool, fsm, logits, vocab: chain.greedy_pick(logits)  # the drafter's plain argmax
    tree.masked_logits = lambda pool, fsm, logits, vocab: logits  # a tree's: the drafter's own candidates,
    constraints.permits = lambda pool, states, tokens: jnp.ones(tokens.shape, bool)  # each one a child
    jax.clear_caches()
    run("constrained, unmasked drafts", True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
