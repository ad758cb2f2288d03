"""/metrics: the engine's figures (`dflash_jax.engine.streaming.EngineMetrics`) in Prometheus's
text format, and the `dflash_ready` gauge (0 while the server warms up)."""


def render_metrics(m) -> str:
    """The engine's figures in Prometheus's text format."""
    lines: list[str] = []

    def metric(name, kind, help_text, samples):
        lines.append(f"# HELP dflash_{name} {help_text}")
        lines.append(f"# TYPE dflash_{name} {kind}")
        for labels, value in samples:
            lines.append(f"dflash_{name}{labels} {value}")

    def histogram(name, help_text, h):
        samples, seen = [], 0
        for bound, n in zip(h.bounds, h.counts):
            seen += n
            samples.append((f'_bucket{{le="{bound}"}}', seen))
        samples += [('_bucket{le="+Inf"}', h.count), ("_sum", round(h.sum, 6)), ("_count", h.count)]
        metric(name, "histogram", help_text, samples)

    with m.lock:
        metric("requests_running", "gauge", "Requests decoding in a slot.", [("", m.running)])
        metric("requests_waiting", "gauge", "Requests queued for a slot.", [("", m.waiting)])
        metric("requests_finished_total", "counter", "Requests ended, by finish reason.",
               [(f'{{finish_reason="{k}"}}', v) for k, v in sorted(m.requests.items())] or [('{finish_reason="stop"}', 0)])
        metric("prompt_tokens_total", "counter", "Prompt tokens admitted.", [("", m.prompt_tokens)])
        metric("prompt_tokens_cached_total", "counter", "Prompt tokens served from the prefix cache (not prefilled).",
               [("", m.cached_prompt_tokens)])
        metric("prefix_cache_hit_rate", "gauge", "Prompt tokens served from the prefix cache, of all prompt tokens.",
               [("", round(m.prefix_hit_rate, 4))])
        metric("generation_tokens_total", "counter", "Tokens generated and sent.", [("", m.generation_tokens)])
        metric("tokens_per_second", "gauge", "Tokens generated per second of time with requests running.",
               [("", round(m.tokens_per_second, 3))])
        metric("tau", "gauge", "Mean acceptance length (tokens per decoding cycle) of finished requests.",
               [("", round(m.tau, 4))])
        histogram("acceptance_length", "Tokens accepted per decoding cycle (the acceptance length).", m.acceptance)
        histogram("time_to_first_token_seconds", "From a request's arrival to its first token.", m.ttft)
        histogram("inter_token_latency_seconds", "Between a stream's successive deliveries of tokens.", m.itl)
        metric("slot_occupancy", "gauge", "Share of slot-syncs that held a running request.",
               [("", round(m.occupancy, 4))])
        metric("batch_slots", "gauge", "Slots of the engine's batch.", [("", m.batch_size)])
        metric("speculation_share", "gauge", "Share of decoding cycles run at each draft length (0: plain "
               "decoding; --speculation auto picks one at each sync).",
               [(f'{{draft_tokens="{k}"}}', round(v, 4)) for k, v in sorted(m.speculation.items())])
    return "\n".join(lines) + "\n"


def metrics_text(engine) -> str:
    """What /metrics answers: the engine's figures once it runs, and whether it is ready."""
    ready = engine is not None
    return (render_metrics(engine.metrics) if ready else "") + (
        "# HELP dflash_ready 1 once the engine has loaded and compiled (0 while warming up).\n"
        f"# TYPE dflash_ready gauge\ndflash_ready {int(ready)}\n")
