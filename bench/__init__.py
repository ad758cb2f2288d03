"""`python -m bench`: the benchmark suite of DFlash speculative decoding.

Prints figures, writes them to JSON (and a PNG plot when matplotlib is importable); it never
asserts a timing. On one device (no mesh), stop tokens ignored so every row generates exactly
its max_new_tokens.

The suite (default mode):
1. Pair: --target DIR --drafter DIR (HF or converted), default the bundled demo pair; --random
   builds a random tiny pair in memory (--hidden, --layers, --heads, --vocab, --drafter-layers).
2. Held-out prompts: snippets (the first lines of functions and classes) cut, seeded, from the
   source of an installed package the target never trained on (--heldout-package, default
   numpy; tests directories skipped). With a tokenizer they are tokenised as raw text (code
   continuation, no chat template); without one, seeded random token ids of a similar length
   stand in for them (the output says so).
3. For every batch size and block size: tau, the acceptance histogram, the per-slot acceptance
   rate P(a >= k) (k = 1..B-1), DFlash tokens/s next to the baseline's (the same engine with no
   drafter, block size 1), DFlash outputs == baseline outputs (greedy: losslessness; with
   --temperature the rows share per-position keys, so sampled rows match too), the loop cycles
   the engine ran (counted in an untimed run: continuous batching admits rows as slots free),
   the compilations seen during the timed runs (programs the engine's jitted entry points gained; should be 0) and peak
   memory. Each engine is warmed up (BatchEngine.warmup + the untimed counting run) and
   `generate` is timed --repeats times (median). --quick: the drafter's block size only.
4. Time split of one cycle: the engine's own pieces (dflash_jax.engine draft, verify,
   accept + commit, cycle, and drafter.extend_context) on the state after the engine's prefill,
   each run n times in a lax.fori_loop on the device (as the engine's cycles run in a
   while_loop; no per-call dispatch), median of interleaved rounds; `passes` runs draft,
   verify and extend_context back to back in one loop body, as a cycle runs them, and the
   cycle's bookkeeping is cycle - passes. cost_ratio = cycle / AR step (the baseline's verify),
   speedup_check = tau / cost_ratio (next to the measured speedup), and the host overhead per
   cycle = (generate wall time - the run's prefill calls, replayed) / loop cycles - cycle.
5. The same target under Hugging Face transformers `generate` (PyTorch, CPU), same prompts,
   left-padded batches (--no-transformers skips it; HF target directories only).

Other modes:
--cost              hardware-independent cost report at the published Qwen3-8B + 5-layer block-16
                    drafter shapes (--scale, default 0.25), abstract weights: XLA's flops and
                    bytes of an AR step and a DFlash cycle, corrected for loops XLA counts once,
                    against the ideal bytes; H200 and TPU v5p rooflines; projected speedup.
--published-shapes  the same shapes with random weights, the engine's pieces timed.
--cache-scaling     tokens/s with a BatchEngine max_prompt_len of 128 and of 8192 (demo pair).
--mixed-workload    tokens/s with per-row max_new_tokens spread over 8..256 vs all at the mean.
--page-pool         concurrent rows of mixed-length rows in the same K/V memory: per-slot caches
                    against a page pool (BatchEngine kv_pages); the tokens must be the same.
--vllm              this engine and vLLM (installed beside it: README) on the same pair, held-out
                    prompts and settings, plain and DFlash in alternating runs: token equality,
                    both engines' tau, tokens/s (bench.vllm_peer). --vllm-fix-knorm: vLLM's
                    CPU build norms every drafter layer's context keys with layer 0's k_norm; fix
                    that in this process.
--serve             the OpenAI-compatible server (python -m infer.serve) under 1, batch and 32
                    concurrent streams: tokens/s, TTFT and inter-token latency p50/p99, streams
                    equal to offline; against the offline engine on the same prompts
                    (bench.serve_bench).

    python -m bench                                   # bundled demo pair
    python -m bench --target DIR --drafter DIR [--dtype bfloat16] [--block-sizes 4,8,16]
        [--batch-sizes 1,8] [--num-prompts 16] [--max-new-tokens 128] [--repeats 3]
        [--heldout-package numpy] [--no-transformers] [--json runs/bench/suite.json] [--plot FILE]
    python -m bench --random --quick [--temperature 0.7]   # quick table on a random pair
    python -m bench --cost [--scale 0.25] [--context 1024] [--cache-len N] [--batch-size 8]
    python -m bench --published-shapes [--scale 0.05] [--context 1024]
    python -m bench --cache-scaling | --mixed-workload
    python -m bench --page-pool [--batch-size 8] [--pool-slots 32] [--page-size 16]
    python -m bench --vllm [--vllm-fix-knorm] [--target DIR --drafter DIR] [--batch-size 8] [--max-new-tokens 128]

Its modules: `cli` (the command line), `suite` (the suite), `pairs` and `prompts` (what it runs),
`timing` (engines and their pieces timed, compile counts, peak memory), `report` (tables, JSON, the
plot), `hf` (the transformers reference), `cost` and `moe_cost` (--cost, --moe-cost), `published`
(--published-shapes), `workloads` (--cache-scaling, --mixed-workload, --page-pool), `vllm_peer`
(--vllm), `serve_bench` (--serve), `prefix_bench` (--prefix-cache-ttft), `draft_window`
(--draft-window), `aot` and `aot_sweep` (--aot, --batch-sweep); stand-alone measurements:
`convert_memory`, `train_input`, `constrained` (structured output's tau and tokens/s), `delta_rule_tpu`, `fp8_moe_tpu`, `int4_tpu`, `mxfp4_moe_tpu`, `moe_tpu` (the engine's MoE block by the TPU compiler), `mla_tpu`, `shipped_tpu` (the biggest targets as shipped: fit and whole-model estimates), and `device_check`
(pieces of `device_check.sh`, the GPU check).
"""

from bench.cost import (
    HARDWARE, cycle_cost, gather_counts_table, ideal_bytes, lookup_correction, loop_correction, piece_costs, run_cost,
    xla_cost,
)
from bench.hf import bench_transformers
from bench.pairs import (
    Pair, directory_pair, param_bytes, param_count, random_configs, random_pair, random_params,
)
from bench.prompts import (
    DEF_LINE, SKIP_DIRS, heldout_snippets, package_files, package_root, package_version, prompt_ids,
)
from bench.published import PAPER_TAU, run_published_shapes
from bench.report import acceptance_figures, config_label, print_tables, write_outputs, write_plot
from bench.timing import (
    bench_generator, compile_counts, counted_generate, delta, first_state, piece_calls, pieces, split_figures,
    synthetic_state, time_calls, time_pieces, time_prefill,
)
from bench.workloads import run_cache_scaling, run_mixed_workload, run_page_pool
from bench.cli import build_parser, main  # noqa: E402
