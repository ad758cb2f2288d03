"""What `python -m infer` (and `train.generate_data`) shows of a job: rows on a terminal as
readable text beside their prompts (JSON lines otherwise: `dflash_jax.generation.JsonlWriter`),
the summary on stderr, the demo's one completion, and --summary-json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from dflash_jax.generation import GenerationResult, InputRow, JsonlWriter, OutputWriteError, write_failure


class Writer(JsonlWriter):
    """The job's writer: JSON lines, appended to --output, or without one on stdout: JSON lines
    when redirected, readable text on a terminal."""

    def __init__(self, path: str | Path | None):
        super().__init__(path)
        self.readable = not self.owned and self.file.isatty()

    def format(self, record: dict, row: InputRow | None) -> str:
        if self.readable:
            return readable_record(record, prompt_text(row) if row is not None else None)
        return super().format(record, row)


def prompt_text(row: InputRow) -> str | None:
    """The text a row asked about: its prompt, or its last user message; for an `input_ids` row
    (no text to show: the writer has no tokenizer) its token ids, abbreviated when long."""
    if row.kind == "prompt":
        return row.value
    if row.kind == "turns":
        return row.value[-1] + "\n"
    if row.kind == "messages":
        return row.value[-1]["content"] + "\n"
    if row.kind == "input_ids":
        return "input_ids " + abbreviated_ids(row.value) + "\n"
    return None


def abbreviated_ids(ids, head: int = 8) -> str:
    """Token ids as a list, all of them up to head + 2, else the first `head` and the count:
    `[12, 5, 99, ... 240 ids]`."""
    ids = [int(i) for i in ids]
    if len(ids) <= head + 2:
        return "[" + ", ".join(map(str, ids)) + "]"
    return "[" + ", ".join(map(str, ids[:head])) + f", ... {len(ids)} ids]"


def readable_record(record: dict, prompt: str | None) -> str:
    """A row for a person: its id and figures, then the prompt and the completion after >>>."""
    if "error" in record:
        return f"--- {record['id']}: error: {record['error']}\n"
    acc, plain = record.get("acceptance_lengths") or [], record.get("plain_cycles", 0)
    # tau over the cycles that drafted (auto speculation's plain cycles apart; block size 1: none)
    tau = f", tau {sum(acc) / len(acc):.2f}" if acc and (plain or max(acc) > 1) else ""
    if plain:
        tau += f" over {len(acc)} drafting cycles, {plain} plain" if acc else f", {plain} plain cycles, none drafted"
    head = f"--- {record['id']}: {record['num_output_tokens']} tokens ({record['finish_reason']}{tau})"
    body = record.get("text")
    if body is None:
        body = " ".join(map(str, record["output_ids"]))
    return f"{head}\n{prompt or ''}>>>{body}\n\n"


def report(result: GenerationResult, summary_json: str | None = None, quiet: bool = False):
    """The end of a run, on process 0: the summary on stderr, the demo's completion (unless
    quiet), the summary as JSON to `summary_json`. When nothing ran (every row was already done,
    which `run_job` says in one line), only `summary_json`: a summary of no rows, naming the
    rows already done. A summary that cannot be written is an OutputWriteError."""
    import jax

    if jax.process_index() != 0:
        return
    if result.summary is None:
        if summary_json:
            write_summary(summary_json, {"rows": 0, "errors": 0, "already_done": result.skipped,
                                         "note": f"all {result.skipped} rows were already done; nothing ran"})
        return
    print_summary(result.summary, lambda *a: print(*a, file=sys.stderr))
    if result.sample is not None and not quiet:
        prompt, text = result.sample
        print(f"\none completion (prompt, then >>> and the generated text):\n{prompt}>>>{text}", file=sys.stderr)
    if summary_json:
        write_summary(summary_json, result.summary)


def write_summary(path: str, summary: dict):
    try:
        Path(path).write_text(json.dumps(summary, indent=2) + "\n")
    except OSError as e:
        raise OutputWriteError(write_failure(path, e, False)) from None


def print_summary(s: dict, say):
    """The summary for a person: what ran (the draft lengths' shares of the cycles; where auto
    ran plain decoding, why), tau over the cycles that drafted, and, with a baseline, the speedup
    where every cycle drafted."""
    from dflash_jax.generation import draft_length_name

    say("")
    say(f"rows {s['rows']} (errors {s['errors']}), output tokens {s['output_tokens']}, "
        f"{s['seconds']:.2f}s, {s['tokens_per_second']:.1f} tokens/s")
    if "prefix_cache" in s:
        p = s["prefix_cache"]
        say(f"prefix cache: {p['cached_prompt_tokens']} of {p['prompt_tokens']} prompt tokens served from cached "
            f"pages (hit rate {p['hit_rate']:.1%})")
    if s["block_size"] == 1:  # one token per step: no acceptance to speak of
        say(f"plain autoregressive decoding (block size 1): {s['cycles']} decoding steps")
        return
    drafts = s.get("draft_tokens")
    verified = f" ({drafts} drafts verified per drafting cycle)" if drafts and drafts != s["block_size"] - 1 else ""
    if s.get("tree_budget"):
        verified = f" (a draft tree of {s['tree_budget']} nodes verified per drafting cycle)"
    if s.get("dflash2"):
        verified += (" (a DFlash2 drafter: drafts drawn from its candidate selector, accepted by rejection sampling)"
                     if s["acceptance"] == "rejection" else " (a DFlash2 drafter: its candidate selector's drafts)")
    spec = s.get("speculation", {})
    if spec.get("fixed"):
        say(f"speculation fixed, not auto: {spec['fixed']}")
    if "heldout" in s:  # the demo pair: the figure to expect first
        h = s["heldout"]
        say(f"this drafter's tau on held-out code ({h['prompts']}, block {h['block_size']}): {h['tau']}, the "
            f"figure to expect on new code (`{h['command']}`)")
    if spec.get("share"):
        shares = ", ".join(f"{draft_length_name(k, s.get('tree_budget', 0))} {v:.1%}" for k, v in spec["share"].items())
        say(f"speculation {spec['mode']}: the engine's cycles by draft length: {shares}")
    if spec.get("plain"):
        say(spec["plain"])
    plain = s.get("plain_cycles", 0)
    where = s.get("prompts", "these prompts")
    if s["tau"] is None:  # auto ran plain decoding only: no acceptance to speak of
        say(f"block size {s['block_size']}{verified}: no cycle drafted ({plain} plain decoding cycles), so no tau, "
            f"on {where}")
    else:
        over = f"the {s['cycles']} row cycles that drafted" if plain else f"{s['cycles']} cycles"
        rest = f" (of {s['cycles'] + plain}; {plain} ran plain decoding, one token each)" if plain else ""
        say(f"block size {s['block_size']}{verified}: tau {s['tau']:.3f} (mean tokens per cycle) over {over}{rest} "
            f"on {where}")
    if "heldout" in s and s["tau"] is not None and s["tau"] > s["heldout"]["tau"]:
        say("  (above the held-out figure: completions that repeat a line are drafted whole; each row's tau is "
            "in its output)")
    hist = s["acceptance_histogram"]
    if hist:
        total = sum(hist.values())
        say("acceptance length histogram (cycles that drafted):" if plain else "acceptance length histogram:")
        for k, v in hist.items():
            say(f"  {int(k):3d}: {v:7d} ({100 * v / total:5.1f}%)")
    if "baseline" in s:
        base = s["baseline"]["tokens_per_second"]
        if s.get("speedup") is not None:
            on = s.get("timed_on", "")
            timed = f", both timed on this machine's {on.upper()}" if on else ""
            say(f"baseline (block size 1): {base:.1f} tokens/s; speedup {s['speedup']}x (DFlash against plain "
                f"decoding{timed})")
        else:
            say(f"baseline (block size 1): {base:.1f} tokens/s")
    if "no_speedup" in s:
        say(s["no_speedup"])
    if "note" in s:
        say(s["note"])
    if "auto" in s:
        say(s["auto"])
