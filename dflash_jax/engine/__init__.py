"""The speculative decoding engine, in three parts:

- `sampling`: how the target picks tokens (greedy, temperature / top-k / top-p, per-row keys);
- `step`: the pure device step (`init_state`, `prefill`, `insert`, `cycle` built from `draft`,
  `verify`, `accept`, `commit`, and `run_cycles`), jit-compiled over static shapes;
- `scheduler`: the host side (`Generator`: slots, continuous batching, syncs; stats).
"""

from dflash_jax.engine.sampling import (
    Sampling, greedy_pick, position_keys, processed_logits, sample,
)
from dflash_jax.engine.scheduler import GenerationStats, Generator, Result, bucket, timed
from dflash_jax.engine.step import (
    DecodeState, EngineSpec, accept, commit, cycle, decode_state_shardings, draft, init_state, insert, prefill,
    run_cycles, verify,
)

__all__ = [
    "Sampling", "greedy_pick", "position_keys", "processed_logits", "sample",
    "GenerationStats", "Generator", "Result", "bucket", "timed",
    "DecodeState", "EngineSpec", "accept", "commit", "cycle", "decode_state_shardings", "draft", "init_state", "insert",
    "prefill", "run_cycles", "verify",
]
