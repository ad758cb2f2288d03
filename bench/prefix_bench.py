"""`python -m bench --prefix-cache-ttft`: the serving engine's prefix cache, time to first token.

The serving engine (`StreamingEngine`, what `python -m infer.serve` runs: per-row sampling, the
server's --sync-every and --prefill-chunk, a page pool of --page-size pages, the prefix cache on)
gets two requests one after the other, each once the one before has finished: a shared prefix of
PREFIX_TOKENS (1024) held-out tokens with two different held-out suffixes. The first
prefills everything; the second finds the prefix's pages cached and prefills its suffix alone. Per
repeat (each with a prefix of its own, so each first request is cold): both times to first token
(from submit to the first token handed to the request) and their ratio (goal: at most 1/3); the
tokens of both must equal the offline engine's without the cache. The default pair's target (the
demo's, a context of 1024) runs with its context raised to 4096, as `demo-target-4k` does
(rotary positions extend to any length: past 1024 the text means nothing, but every position
costs what it would).
"""

from __future__ import annotations

import dataclasses
import statistics
import threading
import time

from bench.suite import describe_pair, get_pair, heldout_prompts, pair_record

PREFIX_TOKENS, SUFFIX_TOKENS = 1024, 64


def one_request(engine, prompt: list[int], max_new: int, row_id: int) -> tuple[float, list[int], float]:
    """Submit one request and wait for it: (seconds to its first token, its tokens, the hit rate
    of the engine's prompt tokens so far)."""
    from dflash_jax.engine import Sampling
    from dflash_jax.engine.streaming import StreamRequest

    done, out = threading.Event(), {}

    def emit(tokens, result):
        if result is not None:
            out["result"] = result
            done.set()

    req = StreamRequest(prompt, max_new, emit, Sampling(per_row=True), row_id=row_id)
    engine.submit(req)
    if not done.wait(1800):
        raise SystemExit("error: a request did not finish within 30 minutes")
    return req.first_token - req.arrived, out["result"].output_ids, engine.metrics.prefix_hit_rate


def run_prefix_ttft(args) -> dict:
    from dflash_jax.engine import BatchEngine, Sampling
    from dflash_jax.engine.scheduler import bucket
    from dflash_jax.engine.streaming import StreamingEngine

    pair = get_pair(args)
    n, shared = args.max_new_tokens, PREFIX_TOKENS
    need = shared + SUFFIX_TOKENS + n
    if pair.target.max_position_embeddings < need:
        if not pair.demo:
            raise SystemExit(f"error: a {shared}-token prefix + {SUFFIX_TOKENS} + {n} new tokens is more than the "
                             f"target's context ({pair.target.max_position_embeddings})")
        pair = dataclasses.replace(pair, target=pair.target.replace(max_position_embeddings=4096),
                                   name=pair.name + ", context raised to 4096 (demo-target-4k)")
    print(describe_pair(pair))
    prompts, _, _ = heldout_prompts(args, pair, max(args.num_prompts, args.repeats + 2))
    stream = [t for p in prompts for t in p]
    if len(stream) < shared + len(prompts):
        raise SystemExit(f"error: the held-out prompts hold {len(stream)} tokens, fewer than the {shared} of the "
                         f"prefix; raise --num-prompts")
    pairs = []
    for r in range(args.repeats):  # each repeat's prefix starts at another prompt: its first request is cold
        start = sum(len(p) for p in prompts[:r])
        prefix = (stream[start:] + stream[:start])[:shared]
        suffixes = [prompts[(r + k + 1) % len(prompts)][:SUFFIX_TOKENS] for k in (0, 1)]
        pairs.append([prefix + s for s in suffixes])
    max_prompt = bucket(max(len(p) for two in pairs for p in two))
    kw = dict(batch_size=args.batch_size or 2, max_new_tokens=n, max_prompt_len=max_prompt,
              page_size=args.page_size, prefill_chunk=args.serve_prefill_chunk, sync_every=args.serve_sync_every,
              speculation="fixed")
    probe = BatchEngine(pair.target, pair.tparams, pair.drafter, pair.dparams, **kw)
    kw["kv_pages"] = pages = (kw["batch_size"] + 2) * probe.pages_needed(max_prompt, n)
    gen = BatchEngine(pair.target, pair.tparams, pair.drafter, pair.dparams, sampling=Sampling(per_row=True),
                      prefix_cache=True, **kw)
    engine = StreamingEngine(gen)
    t = time.perf_counter()
    engine.warmup()
    print(f"serving engine warm in {time.perf_counter() - t:.1f}s ({pages} pages of {args.page_size}, batch "
          f"{kw['batch_size']}, pieces of {args.serve_prefill_chunk}, sync every {args.serve_sync_every})")
    offline = BatchEngine(pair.target, pair.tparams, pair.drafter, pair.dparams, prefix_cache=False, **kw)
    want = [[r.output_ids for r in sorted(offline.generate(two), key=lambda r: r.index)] for two in pairs]
    runs = []
    engine.start()
    try:
        for r, two in enumerate(pairs):
            (first, a, _), (second, b, rate) = (one_request(engine, p, n, 2 * r + k) for k, p in enumerate(two))
            runs.append(dict(first_ttft_ms=round(first * 1e3, 1), second_ttft_ms=round(second * 1e3, 1),
                             ratio=round(second / first, 3), tokens_equal_offline=[a, b] == want[r]))
            print(f"repeat {r}: TTFT {runs[-1]['first_ttft_ms']} ms (cold) -> {runs[-1]['second_ttft_ms']} ms "
                  f"(prefix cached): {runs[-1]['ratio']}x; tokens equal offline: {runs[-1]['tokens_equal_offline']}")
        hit_rate = engine.metrics.prefix_hit_rate
    finally:
        engine.close(timeout=120)
    median = {k: statistics.median(run[k] for run in runs) for k in ("first_ttft_ms", "second_ttft_ms", "ratio")}
    print(f"median over {len(runs)}: first {median['first_ttft_ms']} ms, second {median['second_ttft_ms']} ms, "
          f"ratio {median['ratio']:.3f} (goal <= 0.333); prompt tokens from the cache: {hit_rate:.1%}")
    return dict(pair=pair_record(pair), prefix_tokens=shared, suffix_tokens=SUFFIX_TOKENS,
                prompt_lengths=[[len(p) for p in two] for two in pairs], **kw, repeats=runs,
                median=median, prefix_hit_rate=round(hit_rate, 4),
                tokens_equal_offline=all(run["tokens_equal_offline"] for run in runs))
