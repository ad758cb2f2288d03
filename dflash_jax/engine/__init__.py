"""The speculative decoding engine:

- `sampling`: how the target picks tokens: each row's `RowSampling` (greedy or temperature / top-k /
  top-p, its key, logit bias, constraint and logprobs slots), built by `rows_of`, read by `pick`;
- `step`: the pure device step (`EngineSpec`, `init_state`, `prefill`, `insert`, `cycle`: the spec's
  kind's draft, verify and accept, then `commit`; `run_cycles`), jit-compiled over static shapes;
- `cycles`: the cycle kind as a type (`Plain`, `Chain`, `Selector`, `Tree`; `cycle_kind`, the one
  home of the rules of draft tokens, draft trees and acceptance), one module per kind with its draft
  and verify (`plain`, `chain`, `selector`: a DFlash2 drafter's walk, `tree`: a draft tree), and
  `base`: the pieces they share (`denoise`, `verify`, `accept`, `pick`);
- `tree`: draft trees (`build_tree`, best-first on the device; `follow`, sample-and-match);
- `slots`: the host's ledger of a batch's slots (`SlotLedger`: occupants, slots being filled,
  pages held, the waiting rows, the stop-token cut, finishing rows), `Result`, `GenerationStats`;
- `scheduler`: the batch generator (`BatchEngine`: admission, continuous batching, syncs, warm-up);
- `streaming`: the serving engine (`StreamingEngine`: a BatchEngine fed by a queue of requests on a
  thread of its own, each row's tokens streamed at every sync; its live `EngineMetrics`);
- `tree`: tree verification's draft tree (`build_tree`, best-first on the device) and its
  sample-and-match walk (`follow`);
- `speculation`: auto speculation, which draft length the next cycles run (`Speculation`, `choose`);
- `options`: `EngineOptions`, how a `BatchEngine` runs, one frozen type the commands share;
- `constraints`: structured output on the device (`ConstraintPool`: each slot's region of automaton
  states; `allowed`, `advance`, `walk`; the host's `ConstraintRegions`);
- `watchdog`: the host's waits on the device, each bounded (`Watchdog`: a stall ends the run).
"""

from dflash_jax.engine.sampling import (
    RowSampling, Sampling, greedy_pick, pick, position_keys, processed_logits, rows_of,
)
from dflash_jax.engine.scheduler import BatchEngine, bucket
from dflash_jax.engine.slots import GenerationStats, Result, SlotLedger, timed
from dflash_jax.engine.cycles import CycleKind, cycle_kind
from dflash_jax.engine.cycles.base import accept, verify
from dflash_jax.engine.step import (
    DecodeState, EngineSpec, commit, cycle, decode_state_shardings, draft, init_state, insert, prefill, run_cycles,
)

__all__ = [
    "RowSampling", "Sampling", "greedy_pick", "pick", "position_keys", "processed_logits", "rows_of",
    "GenerationStats", "BatchEngine", "Result", "SlotLedger", "bucket", "timed",
    "CycleKind", "cycle_kind",
    "DecodeState", "EngineSpec", "accept", "commit", "cycle", "decode_state_shardings", "draft", "init_state", "insert",
    "prefill", "run_cycles", "verify",
]
