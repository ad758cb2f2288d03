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
    acc = record.get("acceptance_lengths") or []
    tau = f", tau {sum(acc) / len(acc):.2f}" if acc and max(acc) > 1 else ""
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
    verified = f" ({drafts} drafts verified per cycle)" if drafts and drafts != s["block_size"] - 1 else ""
    if s.get("tree_budget"):
        verified = f" (a draft tree of {s['tree_budget']} nodes verified per cycle)"
    if s.get("dflash2"):
        verified += (" (a DFlash2 drafter: drafts drawn from its candidate selector, accepted by rejection sampling)"
                     if s["acceptance"] == "rejection" else " (a DFlash2 drafter: its candidate selector's drafts)")
    if "fixed" in s.get("speculation", {}):
        say(f"speculation fixed, not auto: {s['speculation']['fixed']}")
    if "heldout" in s:  # the demo pair: the figure to expect first
        h = s["heldout"]
        say(f"this drafter's tau on held-out code ({h['prompts']}, block {h['block_size']}): {h['tau']}, the "
            f"figure to expect on new code (`{h['command']}`)")
    say(f"block size {s['block_size']}{verified}: tau {s['tau']:.3f} (mean tokens per cycle) over {s['cycles']} cycles "
        f"on {s.get('prompts', 'these prompts')}")
    if "heldout" in s and s["tau"] > s["heldout"]["tau"]:
        say("  (above the held-out figure: completions that repeat a line are drafted whole; each row's tau is "
            "in its output)")
    hist = s["acceptance_histogram"]
    if hist:
        total = sum(hist.values())
        say("acceptance length histogram:")
        for k, v in hist.items():
            say(f"  {int(k):3d}: {v:7d} ({100 * v / total:5.1f}%)")
    if "baseline" in s:
        say(f"baseline (block size 1): {s['baseline']['tokens_per_second']:.1f} tokens/s; speedup {s['speedup']}x")
    if "note" in s:
        say(s["note"])
