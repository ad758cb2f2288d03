"""Load and soak: mixed traffic against the server on loopback for a bounded time (heavy).

`python -m infer.serve` runs the demo pair with a page pool (prefix caching on, auto speculation,
the server's defaults otherwise) in a subprocess; clients send, until the time is up, a mix of:
random prompt lengths, prompts that share long prefixes (whole pages: prefix-cache hits), greedy and
seeded sampled requests, streamed and not, cancelled streams (the client goes away after a few
chunks), stop strings and stop token ids, `n` of 1 to 3 choices (and over the server's limit, which
it refuses with a 400), and repeats of the same requests. At the end:

- nothing is lost or duplicated: every accepted request's rows (one per choice) ended exactly once
  (the server's finished-requests counter equals the rows it accepted), every choice of an answer
  that was not cancelled has a finish reason and at most max_tokens tokens, and every repeat of a greedy request, or of a
  sampled one with its seed, streamed or not, got the same tokens as its first run;
- the page pool is whole again (its free and cached pages are all its pages, and no row holds any);
- the server's memory does not grow after the first minute: its resident set, sampled every
  second, stays within MEMORY_SLACK of its level at the end of the first minute.

2 minutes by default (CI: the heavy suite's time budget); `--soak-minutes N` runs it longer by hand.
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import threading
import time

import pytest

from infer.serve.prepare import MAX_N

from test_serve import REPO, START_TIMEOUT, Server, free_port, tail

pytestmark = pytest.mark.heavy

MEMORY_SLACK = 64 << 20  # bytes the resident set may rise above its level at one minute (allocator noise)
KV_PAGES = 96  # pages of 16 positions: fewer than 8 rows of the longest prompts and limits, so prompts wait for pages
CONCURRENCY = 12  # clients at once, against 8 slots: requests queue
PREFIX_TOKENS = (64, 128, 96)  # shared prefixes, whole pages


def rss(pid: int) -> int:
    """The resident set of a process, in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


class Sampler(threading.Thread):
    """The server's resident set every second, with the time since the traffic started."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.samples, self.stopped, self.start_time = pid, [], threading.Event(), time.monotonic()

    def run(self):
        while not self.stopped.wait(1.0):
            self.samples.append((time.monotonic() - self.start_time, rss(self.pid)))


def make_request(rng: random.Random, prefixes: list[list[int]], repeats: list[dict]) -> dict:
    """One request body of the mix (a repeat of an earlier one, one time in four)."""
    if repeats and rng.random() < 0.25:
        return dict(rng.choice(repeats))
    if rng.random() < 0.5:
        prompt = rng.choice(prefixes) + [rng.randrange(5, 4000) for _ in range(rng.randrange(1, 40))]
    else:
        prompt = [rng.randrange(5, 4000) for _ in range(rng.choice((1, 3, 17, 40, 90, 150)))]
    body = dict(prompt=prompt, max_tokens=rng.randrange(1, 48), return_token_ids=True, stream=rng.random() < 0.6)
    if rng.random() < 0.5:
        body["temperature"] = 0
    else:
        body.update(temperature=rng.choice((0.7, 1.0)), top_p=rng.choice((1.0, 0.9)), seed=rng.randrange(1000))
    kind = rng.random()
    if kind < 0.15:
        body["stop"] = rng.choice(["\n\n", ["return", ")"], ":"])
    elif kind < 0.25:
        body["stop_token_ids"] = [rng.randrange(5, 4000) for _ in range(3)]
    if rng.random() < 0.1:
        body["n"] = rng.choice((1, 2, 3, MAX_N + 1))
    return body


async def send(client, url: str, body: dict, cancel_after: int | None) -> dict:
    """One request; returns what came back: status, each choice's token ids and finish reason (by
    index), whether it was cancelled."""
    if not body["stream"]:
        r = await client.post(f"{url}/v1/completions", json=body, timeout=300)
        if r.status_code != 200:
            return dict(status=r.status_code, error=r.json()["error"]["message"])
        choices = r.json()["choices"]
        assert [c["index"] for c in choices] == list(range(body.get("n", 1))), choices
        return dict(status=200, ids=[c["token_ids"] for c in choices], finish_reason=[c["finish_reason"] for c in choices],
                    cancelled=False)
    n = body.get("n", 1)
    ids, reason, chunks = [[] for _ in range(n)], [None] * n, 0
    async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
        if r.status_code != 200:
            await r.aread()
            return dict(status=r.status_code, error=json.loads(r.text)["error"]["message"])
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            i = choice["index"]
            assert reason[i] is None, f"choice {i} went on after its finish reason"
            ids[i] += choice.get("token_ids") or []
            reason[i] = choice.get("finish_reason")
            chunks += 1
            if cancel_after is not None and chunks >= cancel_after and None in reason:
                return dict(status=200, ids=ids, finish_reason=reason, cancelled=True)  # the client goes away
    return dict(status=200, ids=ids, finish_reason=reason, cancelled=False)


async def traffic(url: str, seconds: float, seed: int) -> list[tuple[dict, dict]]:
    import httpx

    rng = random.Random(seed)
    prefixes = [[rng.randrange(5, 4000) for _ in range(n)] for n in PREFIX_TOKENS]
    repeats: list[dict] = []
    log: list[tuple[dict, dict]] = []
    deadline = time.monotonic() + seconds

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=CONCURRENCY + 4)) as client:
        async def worker(w: int):
            wrng = random.Random(seed * 100 + w)
            while time.monotonic() < deadline:
                body = make_request(wrng, prefixes, repeats)
                cancel_after = wrng.choice((1, 2, 3)) if body["stream"] and wrng.random() < 0.15 else None
                got = await send(client, url, body, cancel_after)
                log.append((body, got))
                if got["status"] == 200 and not got["cancelled"] and len(repeats) < 64:
                    repeats.append(body)

        await asyncio.gather(*(worker(w) for w in range(CONCURRENCY)))
    return log


def check_answers(log: list[tuple[dict, dict]]) -> dict:
    """Every answer is whole and every repeat equals its first run; returns counts by outcome."""
    first: dict[str, list[int]] = {}
    counts = dict(ok=0, cancelled=0, refused_n=0, repeats=0, choices=0)
    for body, got in log:
        if body.get("n", 1) > MAX_N:
            assert got["status"] == 400 and "limit" in got["error"], got
            counts["refused_n"] += 1
            continue
        assert got["status"] == 200, (body, got)
        assert all(len(ids) <= body["max_tokens"] for ids in got["ids"])
        if got["cancelled"]:
            counts["cancelled"] += 1
            continue
        for ids, reason in zip(got["ids"], got["finish_reason"], strict=True):
            assert reason in ("stop", "length"), got
            assert reason == "stop" or len(ids) == body["max_tokens"]
        counts["ok"] += 1
        counts["choices"] += len(got["ids"]) > 1
        key = json.dumps({k: v for k, v in body.items() if k != "stream"}, sort_keys=True)
        if key in first:
            assert got["ids"] == first[key], f"a repeat of {key[:200]} got other tokens"
            counts["repeats"] += 1
        else:
            first[key] = got["ids"]
    return counts


def test_mixed_traffic_soak(tmp_path, request):
    pytest.importorskip("httpx")
    minutes = request.config.getoption("--soak-minutes")
    log_path = tmp_path / "server.txt"
    port = free_port()
    with open(log_path, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "infer.serve", "--port", str(port), "--batch-size", "8",
                                 "--max-prompt-len", "256", "--max-new-tokens", "48", "--kv-pages", str(KV_PAGES),
                                 "--page-size", "16", "--max-waiting", "256", "--prefill-chunk", "128"],
                                cwd=REPO, stdout=subprocess.DEVNULL, stderr=f)
    server = Server(proc, port, log_path)
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while "serving " not in (log_path.read_text(errors="replace") if log_path.is_file() else ""):
            assert proc.poll() is None, f"the server exited before serving:\n{tail(log_path)}"
            assert time.monotonic() < deadline, f"the server was not serving after {START_TIMEOUT} s"
            time.sleep(0.5)
        sampler = Sampler(proc.pid)
        sampler.start()
        log = asyncio.run(traffic(server.url, 60 * minutes, seed=0))
        sampler.stopped.set()
        metrics = server.wait_idle(timeout=120)
        counts = check_answers(log)
        accepted = sum(body.get("n", 1) for body, got in log if got["status"] == 200)  # rows: one per choice
        finished = sum(v for k, v in metrics.items() if k.startswith("dflash_requests_finished_total"))
        assert finished == accepted, f"{accepted} requests accepted, {finished} ended"
        assert counts["ok"] > 50 and counts["cancelled"] > 0 and counts["repeats"] > 0 and counts["refused_n"] > 0
        assert counts["choices"] > 0
        assert metrics["dflash_prefix_cache_hit_rate"] > 0  # the shared prefixes were served from the cache
        total = metrics["dflash_kv_pages_total"]
        assert total == KV_PAGES and metrics["dflash_kv_pages_held"] == 0
        assert metrics["dflash_kv_pages_free"] + metrics["dflash_kv_pages_cached"] == total
        at_one_minute = next(r for t, r in sampler.samples if t >= 60)
        later = [r for t, r in sampler.samples if t >= 60]
        grew = max(later) - at_one_minute
        print(f"soak {minutes} min: {counts}; {len(log)} requests; server RSS {at_one_minute >> 20} MiB at 1 min, "
              f"max {max(later) >> 20} MiB after; prefix-cache hit rate {metrics['dflash_prefix_cache_hit_rate']:.3f}")
        assert grew <= MEMORY_SLACK, f"the server's memory grew {grew >> 20} MiB after the first minute"
    finally:
        assert server.stop() == 0, tail(log_path)
