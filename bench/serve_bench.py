"""`python -m bench --serve`: the OpenAI-compatible server (`python -m infer.serve`) under load,
against the offline engine on the same rows (figures only; nothing is asserted).

The server runs in a subprocess, as it is deployed; this process is its clients (asyncio, HTTP
streams, greedy, each request with max_tokens --max-new-tokens and `return_token_ids`). For
each concurrency (--serve-concurrency, default 1, the batch and 32) every held-out prompt is
sent once, at most that many at a time: throughput (generated tokens / wall time), time to first
token and inter-token latency (the gaps between a stream's successive chunks), p50 and p99, and
whether every stream's tokens equal the offline engine's. The offline engine is `python -m
infer`'s: a BatchEngine with the same batch, the target's stop tokens and the CLI's defaults, in
this process; its timed
runs alternate with the served runs at concurrency = batch (the goal: served >= 0.9x offline).
With --serve-long-prompt N, the batch's other streams run while prompts of N tokens arrive one
after another: their inter-token latency p99 against the same streams alone (an admission runs
the prefill of a prompt longer than --serve-prefill-chunk in pieces of it, one between rounds
of cycles, so the streams wait for a piece at a time, not for the whole prompt).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.prompts import describe_prompts
from bench.suite import describe_pair, get_pair, heldout_prompts, int_list, pair_record


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, max_prompt: int, log: Path, extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str]:
    """`python -m infer.serve` on a free port (with `extra` flags); returns (process, base URL) once it serves."""
    port = free_port()
    cmd = [sys.executable, "-m", "infer.serve", "--port", str(port), "--batch-size", str(args.batch_size),
           "--max-new-tokens", str(args.max_new_tokens), "--max-prompt-len", str(max_prompt),
           "--sync-every", str(args.serve_sync_every), "--max-waiting", "1024",
           "--prefill-chunk", str(args.serve_prefill_chunk)]
    if args.target:
        cmd += ["--target", args.target, "--drafter", args.drafter]
    if args.dtype:
        cmd += ["--dtype", args.dtype]
    cmd += list(extra)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(log, "w"), env=os.environ.copy())
    url, t = f"http://127.0.0.1:{port}", time.perf_counter()
    while "serving " not in log.read_text():
        if proc.poll() is not None:
            raise SystemExit(f"error: the server exited ({proc.returncode}):\n{log.read_text()[-2000:]}")
        if time.perf_counter() - t > 1800:
            proc.kill()
            raise SystemExit("error: the server did not start within 30 minutes")
        time.sleep(0.5)
    return proc, url


async def one_stream(client, url: str, prompt: list[int], max_tokens: int) -> dict:
    """One streamed greedy completion: token ids, send / first-token / chunk times."""
    body = dict(prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True, return_token_ids=True)
    sent, chunks, ids, reason = time.perf_counter(), [], [], None
    async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            new = choice.get("token_ids") or []
            if new:
                chunks.append(time.perf_counter())
                ids += new
            reason = choice.get("finish_reason") or reason
    return dict(ids=ids, sent=sent, chunks=chunks, finish_reason=reason)


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


async def served_run(url: str, prompts: list[list[int]], max_tokens: int, concurrency: int) -> dict:
    import httpx

    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency + 4)) as client:
        async def gated(p):
            async with gate:
                return await one_stream(client, url, p, max_tokens)

        t = time.perf_counter()
        streams = await asyncio.gather(*(gated(p) for p in prompts))
        seconds = time.perf_counter() - t
    tokens = sum(len(s["ids"]) for s in streams)
    ttft = [s["chunks"][0] - s["sent"] for s in streams if s["chunks"]]
    itl = [b - a for s in streams for a, b in zip(s["chunks"], s["chunks"][1:])]
    ms = lambda v: None if v is None else round(1000 * v, 2)
    return dict(concurrency=concurrency, seconds=round(seconds, 3), tokens=tokens,
                tokens_per_second=round(tokens / seconds, 2), ttft_ms_p50=ms(pct(ttft, 0.5)),
                ttft_ms_p99=ms(pct(ttft, 0.99)), itl_ms_p50=ms(pct(itl, 0.5)), itl_ms_p99=ms(pct(itl, 0.99)),
                chunks=sum(len(s["chunks"]) for s in streams), outputs=[s["ids"] for s in streams])


async def long_prompt_run(url: str, streams: list[list[int]], long_prompts: list[list[int]], max_tokens: int) -> dict:
    """The streams run together; while they do, the long prompts arrive one after another (each
    with max_tokens 1). The streams' inter-token latency, p50 and p99."""
    import httpx

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=len(streams) + 4)) as client:
        async def longs():
            await asyncio.sleep(0.5)
            for p in long_prompts:
                await one_stream(client, url, p, 1)

        tasks = [one_stream(client, url, p, max_tokens) for p in streams]
        if long_prompts:
            tasks.append(longs())
        done = await asyncio.gather(*tasks)
    itl = [b - a for s in done[:len(streams)] for a, b in zip(s["chunks"], s["chunks"][1:])]
    return dict(itl_ms_p50=round(1000 * pct(itl, 0.5), 2), itl_ms_p99=round(1000 * pct(itl, 0.99), 2),
                itl_ms_max=round(1000 * max(itl), 2), gaps=len(itl))


def metrics_running(url: str) -> dict:
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=30).text
    out = {}
    for line in text.splitlines():
        for name in ("dflash_requests_running", "dflash_requests_waiting", "dflash_tau", "dflash_slot_occupancy"):
            if line.startswith(name + " "):
                out[name.removeprefix("dflash_")] = float(line.split()[1])
        if line.startswith("dflash_speculation_share{"):
            out.setdefault("speculation_share", {})[line.split('"')[1]] = float(line.split()[1])
    return out


def stop_server(proc: subprocess.Popen):
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()
        return None


# The servers `--serve-speculation` compares: plain decoding, DFlash verifying the whole block
# every cycle, and auto speculation (the server's default).
SPECULATION_SERVERS = {"plain": ("--block-size", "1"), "fixed": ("--speculation", "fixed"),
                       "auto": ("--speculation", "auto")}


def serve_setup(args):
    """Both serving benches' start: the batch (default 8), the concurrency levels (default 1, the batch,
    32), the pair and the held-out prompts (as many as the largest level), described as they load."""
    args.batch_size = args.batch_size or 8
    levels = int_list(args.serve_concurrency, "--serve-concurrency") if args.serve_concurrency else \
        sorted({1, args.batch_size, 32})
    pair = get_pair(args)
    print(describe_pair(pair))
    prompts, snippets, kind = heldout_prompts(args, pair, max(args.num_prompts, max(levels)))
    print(describe_prompts(prompts, snippets, kind, args.heldout_package, args.prompt_lines))
    return levels, pair, prompts


def run_speculation_bench(args) -> dict:
    """Served tokens/s of plain decoding, fixed DFlash and auto speculation, each in a server of its
    own (all three up at once, their timed runs alternating, the median of --repeats each) at each
    concurrency; auto against the better of the other two (the goal: >= 0.95x), and every stream's
    tokens equal plain decoding's."""
    from dflash_jax.engine.scheduler import bucket

    levels, pair, prompts = serve_setup(args)
    max_prompt, n = bucket(max(len(p) for p in prompts)), args.max_new_tokens
    servers = {}
    try:
        for name, extra in SPECULATION_SERVERS.items():
            t = time.perf_counter()
            servers[name] = start_server(args, max_prompt, Path(args.json).with_suffix(f".{name}.log"), extra)
            asyncio.run(served_run(servers[name][1], prompts, n, args.batch_size))  # untimed: its first run
            print(f"{name} server up and warm in {time.perf_counter() - t:.1f}s")
        levels_out = {}
        for c in levels:
            runs = {name: [] for name in servers}
            for _ in range(args.repeats):  # alternating: machine load hits all alike
                for name, (_, url) in servers.items():
                    runs[name].append(asyncio.run(served_run(url, prompts, n, c)))
            plain = [r["outputs"] for r in runs["plain"]][0]
            row = {name: dict(tokens_per_second=statistics.median(r["tokens_per_second"] for r in rs),
                              runs=[r["tokens_per_second"] for r in rs],
                              streams_equal_plain=min(sum(o == w for o, w in zip(r["outputs"], plain)) for r in rs))
                   for name, rs in runs.items()}
            best = max(row["plain"]["tokens_per_second"], row["fixed"]["tokens_per_second"])
            row["auto_over_best"] = round(row["auto"]["tokens_per_second"] / best, 3)
            levels_out[str(c)] = row
            print(f"concurrency {c:3d}: " + ", ".join(f"{k} {row[k]['tokens_per_second']:.1f}" for k in servers)
                  + f" tok/s; auto / the better of plain and fixed: {row['auto_over_best']:.2f}x; streams equal "
                  f"plain: {min(row[k]['streams_equal_plain'] for k in servers)}/{len(prompts)}")
        metrics = metrics_running(servers["auto"][1])
        print(f"auto's /metrics: share of cycles per draft length {metrics.get('speculation_share')}, "
              f"tau {metrics.get('tau')}")
        return dict(pair=pair_record(pair), prompts=len(prompts), max_new_tokens=n, batch_size=args.batch_size,
                    sync_every=args.serve_sync_every, repeats=args.repeats, concurrency=levels_out,
                    auto_metrics=metrics)
    finally:
        for proc, _ in servers.values():
            stop_server(proc)


def run_serve_bench(args) -> dict:
    from dflash_jax.engine import BatchEngine
    from dflash_jax.engine.scheduler import bucket
    from dflash_jax.engine.options import SYNC_EVERY
    from dflash_jax.pair import stop_token_ids
    from bench.timing import time_generate

    if args.target and not args.drafter:
        raise SystemExit("error: --serve needs --drafter with --target")
    levels, pair, prompts = serve_setup(args)
    max_prompt = bucket(max(len(p) for p in prompts))
    long_len = args.serve_long_prompt
    if long_len:
        if long_len + args.max_new_tokens > pair.target.max_position_embeddings:
            raise SystemExit(f"error: --serve-long-prompt {long_len} + {args.max_new_tokens} new tokens is more "
                             f"than the target's context ({pair.target.max_position_embeddings})")
        max_prompt = max(max_prompt, long_len)
    n = args.max_new_tokens

    # The offline engine: python -m infer's (greedy, the CLI's sync_every and batch, no narrowing).
    stops = stop_token_ids(pair.target_dir, pair.tokenizer) if pair.target_dir else []
    gen = BatchEngine(pair.target, pair.tparams, pair.drafter, pair.dparams, batch_size=args.batch_size,
                    max_new_tokens=n, max_prompt_len=max_prompt, stop_token_ids=stops, sync_every=SYNC_EVERY, speculation="fixed")
    t = time.perf_counter()
    gen.warmup([len(p) for p in prompts])
    time_generate(gen, prompts, 1, 0)
    print(f"offline engine warm in {time.perf_counter() - t:.1f}s")

    log = Path(args.json).with_suffix(".server.log")
    log.parent.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    proc, url = start_server(args, max_prompt, log)
    print(f"server up at {url} in {time.perf_counter() - t:.1f}s (log: {log})")
    try:
        runs = {}
        offline, served = [], []
        warm = asyncio.run(served_run(url, prompts, n, args.batch_size))  # untimed: the server's first run
        for _ in range(args.repeats):  # alternating: machine load hits both alike
            stats, results = time_generate(gen, prompts, 1, 0)
            offline.append(stats[0].tokens_per_second)
            served.append(asyncio.run(served_run(url, prompts, n, args.batch_size)))
        want = [results[i].output_ids for i in range(len(prompts))]
        for c in levels:
            if c == args.batch_size:  # the median of the alternating runs
                run = sorted(served, key=lambda r: r["tokens_per_second"])[len(served) // 2]
            else:
                run = asyncio.run(served_run(url, prompts, n, c))
            run["equal_offline"] = sum(o == w for o, w in zip(run.pop("outputs"), want))
            runs[c] = run
            print(f"concurrency {c:3d}: {run['tokens_per_second']:8.1f} tok/s, TTFT p50 {run['ttft_ms_p50']} ms "
                  f"p99 {run['ttft_ms_p99']} ms, ITL p50 {run['itl_ms_p50']} ms p99 {run['itl_ms_p99']} ms; "
                  f"{run['equal_offline']}/{len(prompts)} streams equal offline")
        warm.pop("outputs")
        offline_tps = statistics.median(offline)
        ratio = runs[args.batch_size]["tokens_per_second"] / offline_tps
        print(f"offline (python -m infer's engine, batch {args.batch_size}): {offline_tps:.1f} tok/s; served at "
              f"concurrency {args.batch_size}: {ratio:.2f}x (runs: offline {[round(x, 1) for x in offline]}, served "
              f"{[r['tokens_per_second'] for r in served]})")
        out = dict(pair=pair_record(pair), prompts=len(prompts), max_new_tokens=n, batch_size=args.batch_size,
                   sync_every=args.serve_sync_every, prefill_chunk=args.serve_prefill_chunk,
                   max_prompt_len=max_prompt, repeats=args.repeats,
                   offline_tokens_per_second=round(offline_tps, 2),
                   offline_runs=[round(x, 2) for x in offline],
                   served_runs_at_batch=[r["tokens_per_second"] for r in served],
                   served_over_offline=round(ratio, 3), concurrency={str(c): r for c, r in runs.items()})
        if long_len:
            streams = prompts[:args.batch_size - 1]
            base = asyncio.run(long_prompt_run(url, streams, [], n))
            longs = [(prompts[i % len(prompts)] * (long_len // len(prompts[i % len(prompts)]) + 1))[:long_len]
                     for i in range(4)]
            loaded = asyncio.run(long_prompt_run(url, streams, longs, n))
            out["long_prompts"] = dict(tokens=long_len, count=len(longs), streams=len(streams), alone=base,
                                       while_long_prompts_arrive=loaded)
            print(f"{len(streams)} streams, ITL p99: {base['itl_ms_p99']} ms alone, {loaded['itl_ms_p99']} ms while "
                  f"{len(longs)} prompts of {long_len} tokens arrive (max {loaded['itl_ms_max']} ms)")
        out["metrics_after"] = metrics_running(url)
        print(f"after the runs, /metrics: {out['metrics_after']}")
    finally:
        code = stop_server(proc)
    out["server_exit_on_sigterm"] = code
    print(f"server exited with {code} on SIGTERM")
    return out
