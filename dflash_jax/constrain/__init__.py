"""Structured output's host side: a request's constraint compiled once into a token-level automaton
over the target's vocabulary, as numpy arrays the engine loads into its device pool
(docs/structured-output.md).

- `constraint.py`: `Constraint` (regex, json_schema, json_object, choice; hashable text, checked when
  made) and its regex (outlines-core's translation of a schema, bounded whitespace);
- `vocabulary.py`: `vocabulary_of`, a tokenizer's ids -> the bytes each decodes to (byte-level BPE,
  SentencePiece-style with byte fallback), the ids never allowed left out;
- `automaton.py`: `Automaton` (masks, edges, final states) and `compile_constraint` (outlines-core's
  `Index`, renumbered densely, dead states pruned, eos in final states);
- `cache.py`: `ConstraintCache`, automata by constraint, LRU, thread-safe;
- `fields.py`: `constraint_of`, the request's or input row's fields that ask for a constraint
  (`response_format`, `structured_outputs`, `guided_*`), their one home;
- `__main__.py`: `python -m dflash_jax.constrain`, a constraint's size and compile time on a vocabulary.
"""

from dflash_jax.constrain.automaton import MAX_STATES, Automaton, compile_constraint
from dflash_jax.constrain.cache import ConstraintCache
from dflash_jax.constrain.constraint import WHITESPACE, Constraint
from dflash_jax.constrain.vocabulary import TokenVocabulary, vocabulary_of
