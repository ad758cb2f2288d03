"""`python -m dflash_jax.constrain`: a constraint's automaton size and compile time on a tokenizer
(the bundled demo target's by default), e.g.

    python -m dflash_jax.constrain --json-schema '{"type": "object", "properties": {"a": {"type": "integer"}}}'
    python -m dflash_jax.constrain --regex '[0-9]{3}' --tokenizer path/to/model
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from dflash_jax.constrain.automaton import MAX_STATES, compile_constraint, mask_words
from dflash_jax.constrain.constraint import Constraint
from dflash_jax.constrain.vocabulary import vocabulary_of
from dflash_jax.errors import DFlashError

EXAMPLE_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string", "format": "email"},
        "city": {"type": "string", "enum": ["Paris", "Zürich", "São Paulo", "café"]},
        "scores": {"type": "array", "items": {"type": "number"}, "maxItems": 5},
        "address": {"type": "object", "properties": {"street": {"type": "string"}, "zip": {"type": "string",
                                                                                       "pattern": "[0-9]{5}"}},
                    "required": ["street", "zip"]},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "active"],
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dflash_jax.constrain", description=__doc__.splitlines()[0])
    g = p.add_mutually_exclusive_group()
    g.add_argument("--regex")
    g.add_argument("--json-schema", help="a schema (JSON); default: an example schema of nested objects, "
                   "arrays, enums, numbers and strings")
    g.add_argument("--json-object", action="store_true")
    g.add_argument("--choice", nargs="+")
    p.add_argument("--tokenizer", help="a tokenizer's directory (default: the bundled demo target's)")
    p.add_argument("--vocab-size", type=int, help="the padded vocabulary (default: the tokenizer's)")
    p.add_argument("--max-states", type=int, default=MAX_STATES)
    args = p.parse_args(argv)
    import transformers

    path = args.tokenizer or str(Path(__file__).resolve().parents[1] / "demo" / "target")
    try:
        tok = transformers.AutoTokenizer.from_pretrained(path)
        size = args.vocab_size or len(tok)
        eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
        t = time.perf_counter()
        vocab = vocabulary_of(tok, size, eos)
        t_vocab = time.perf_counter() - t
        if args.regex is not None:
            c = Constraint.regex(args.regex)
        elif args.json_object:
            c = Constraint.json_object()
        elif args.choice:
            c = Constraint.choice(args.choice)
        else:
            c = Constraint.json_schema(args.json_schema or EXAMPLE_SCHEMA)
        t = time.perf_counter()
        a = compile_constraint(c, vocab, args.max_states)
        t_compile = time.perf_counter() - t
    except DFlashError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({
        "kind": c.kind, "vocab_size": size, "vocabulary_seconds": round(t_vocab, 3),
        "states": a.num_states, "edges": a.num_edges, "final_states": int(a.final.sum()),
        "bytes": a.nbytes, "mask_bytes": a.masks.nbytes, "edge_bytes": a.tokens.nbytes + a.targets.nbytes,
        "mask_bytes_per_state": 4 * mask_words(size),
        "compile_seconds": round(t_compile, 3),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
