"""`infer.job_output`: what a terminal shows of a row, and the summary shaped from synthetic cycle
records (no model needed)."""

import contextlib
import errno
import io
import json
import re

import pytest

from dflash_jax.generation import InputRow
from infer.job_output import Writer, abbreviated_ids, prompt_text, readable_record

RECORD = {"id": "r", "output_ids": [7, 8], "text": " world", "acceptance_lengths": [2],
          "num_output_tokens": 2, "finish_reason": "length"}


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_abbreviated_ids():
    assert abbreviated_ids([]) == "[]"
    assert abbreviated_ids([12, 5, 99]) == "[12, 5, 99]"
    assert abbreviated_ids(range(10)) == "[0, 1, 2, 3, 4, 5, 6, 7, 8, 9]"  # head + 2: all of them
    assert abbreviated_ids(range(100, 340)) == "[100, 101, 102, 103, 104, 105, 106, 107, ... 240 ids]"


def test_an_input_ids_row_shows_its_ids_before_the_completion():
    short = InputRow("r", 1, "input_ids", [12, 5, 99])
    assert prompt_text(short) == "input_ids [12, 5, 99]\n"
    long = InputRow("r", 1, "input_ids", list(range(1, 241)))
    assert prompt_text(long) == "input_ids [1, 2, 3, 4, 5, 6, 7, 8, ... 240 ids]\n"

    stream = Terminal()
    with contextlib.redirect_stdout(stream):
        Writer(None).write(RECORD, short)
    assert stream.getvalue() == "--- r: 2 tokens (length, tau 2.00)\ninput_ids [12, 5, 99]\n>>> world\n\n"


def test_text_rows_still_show_their_text():
    assert prompt_text(InputRow("r", 1, "prompt", "Hello")) == "Hello"
    assert prompt_text(InputRow("r", 1, "turns", ["hi", "and now?"])) == "and now?\n"
    assert prompt_text(InputRow("r", 1, "messages", [{"role": "user", "content": "hi"}])) == "hi\n"
    assert readable_record(RECORD, prompt_text(InputRow("r", 1, "prompt", "Hello"))).endswith("Hello>>> world\n\n")


def test_a_write_that_fails_keeps_the_lines_before_it_and_says_so_in_one_line(tmp_path):
    """A full disk on the third line: an OutputWriteError naming the file and that a rerun resumes;
    the two lines written before it are whole, and closing the writer raises nothing more."""
    from dflash_jax.generation import OutputWriteError

    out = tmp_path / "out.jsonl"
    writer = Writer(out)
    writer.write(dict(RECORD, id="a"))
    writer.write(dict(RECORD, id="b"))
    real_flush = writer.file.flush

    def full():
        raise OSError(errno.ENOSPC, "No space left on device")

    writer.file.flush = full
    with pytest.raises(OutputWriteError) as err:
        writer.write(dict(RECORD, id="c"))
    assert str(err.value) == f"could not write {out}: No space left on device; the rows written are kept and a " \
                             f"rerun resumes"
    writer.file.flush = real_flush
    writer.close()
    lines = out.read_text().splitlines()
    assert [json.loads(line)["id"] for line in lines[:2]] == ["a", "b"]


# ----------------------------------------------------------------------------- the summary


def cycle_records(plain_cycles: int, drafted: list[list[int]]):
    """Rows of synthetic cycle records, as `SlotLedger.result` makes them (0: a plain cycle)."""
    import numpy as np

    from dflash_jax.engine.slots import SlotLedger

    ledger = SlotLedger(len(drafted), None, frozenset(), lambda row: 0)
    rows = []
    for i, lengths in enumerate(drafted):
        acceptance = np.array([0] * plain_cycles + lengths)
        rows.append(ledger.result(i, np.arange(400), 100, acceptance, len(acceptance)))
    return rows


def job_summary(mode: str, plain_cycles: int, drafted: list[list[int]], policy_cycles: dict, costs_ms: dict,
                rates: float, baseline_speed: float = 1000.0, seconds: float = 1.0) -> dict:
    """The summary `JobRun.summary` shapes, from synthetic records and a policy that saw these figures."""
    import numpy as np

    from dflash_jax.engine.slots import GenerationStats
    from dflash_jax.engine.speculation import Speculation
    from dflash_jax.generation import speculation_summary, speedup_figures

    stats = GenerationStats(16, seconds=seconds)
    for r in cycle_records(plain_cycles, drafted):
        stats.add(r)
    policy = Speculation(tuple(policy_cycles), depth=15, clock=lambda: 0.0)
    for k, ms in costs_ms.items():
        policy.time(k, 8, 1, ms / 1e3)
    for k, n in policy_cycles.items():
        policy.observe(k, 8, n, None, np.full(15, 1e4), np.full(15, 1e4 * rates))
    summary = {"rows": len(drafted), "errors": 0, **stats.summary(), "draft_tokens": 15, "tree_budget": 0,
               "speculation": speculation_summary(mode, policy.summary()), "prompts": "these prompts"}
    summary["baseline"] = {"tokens_per_second": baseline_speed, "block_size": 1, "tau": 1.0}
    summary.update(speedup_figures(summary, summary["baseline"], "cpu"))
    return summary


def printed(summary: dict) -> str:
    from infer.job_output import print_summary

    lines = []
    print_summary(summary, lines.append)
    return "\n".join(lines)


def test_a_fixed_run_says_every_cycle_drafted_and_its_speedup_is_labelled():
    s = job_summary("fixed", 0, [[4, 5, 16], [1, 2]], {15: 40}, {15: 20.0}, 0.7, baseline_speed=400.0)
    assert s["speculation"] == {"mode": "fixed", "share": {"15": 1.0}, "cycles": {"15": 40}}
    assert s["tau"] == 28 / 5 and s["cycles"] == 5 and s["plain_cycles"] == 0
    assert s["speedup"] == round(s["tokens_per_second"] / 400.0, 3) and s["timed_on"] == "cpu"
    text = printed(s)
    assert "speculation fixed: the engine's cycles by draft length: K=15 100.0%" in text
    assert "tau 5.600 (mean tokens per cycle) over 5 cycles on these prompts" in text
    assert f"speedup {s['speedup']}x (DFlash against plain decoding, both timed on this machine's CPU)" in text
    assert "plain" not in text.replace("against plain decoding", "")


def test_auto_that_ran_plain_decoding_says_so_and_why_and_reports_no_tau_or_speedup_over_plain_cycles():
    # Mostly plain: a 16-token verify cost 7 plain steps, drafts accepted at 0.5 each (2 tokens at K=15).
    s = job_summary("auto", 30, [[3], [1]], {0: 60, 3: 2, 15: 2}, {0: 4.0, 3: 12.0, 15: 28.0}, 0.5)
    spec = s["speculation"]
    assert spec["mode"] == "auto" and spec["share"] == {"0": 60 / 64, "3": round(2 / 64, 4), "15": round(2 / 64, 4)}
    assert spec["reading"]["best"] == 0 and spec["reading"]["cycle_ms"]["15"] == 28.0
    tokens15 = spec["reading"]["expected_tokens"]["15"]
    assert tokens15 == pytest.approx(2.0, abs=0.05)  # the prior, against faded counts
    assert spec["plain"].startswith("auto ran plain decoding for 94% of the engine's cycles: on this machine, at 8 slots, ")
    assert f"K=15: a 16-token verify cost 7.0 plain steps for {tokens15:.2f} tokens a cycle" in spec["plain"]
    assert "K=3: a 4-token verify cost 3.0 plain steps" in spec["plain"]
    assert spec["plain"].endswith("so plain decoding gave the most tokens/s")
    # tau over the two drafting cycles only; no speedup over a run of plain cycles
    assert s["tau"] == 2.0 and s["cycles"] == 2 and s["plain_cycles"] == 60
    assert s["speedup"] is None
    assert "auto speculation ran plain decoding for 94% of the engine's cycles, 60 of 62 row cycles" in s["no_speedup"]
    text = printed(s)
    assert spec["plain"] in text and s["no_speedup"] in text and not re.search(r"speedup \d", text)
    assert "tau 2.000 (mean tokens per cycle) over the 2 row cycles that drafted (of 62; 60 ran plain decoding" in text
    assert "K=0 (plain) 93.8%" in text


def test_auto_that_never_drafted_prints_no_tau():
    s = job_summary("auto", 12, [[], []], {0: 12, 15: 0}, {0: 4.0, 15: 40.0}, 0.7)
    assert s["tau"] is None and s["cycles"] == 0 and s["acceptance_histogram"] == {}
    text = printed(s)
    assert "no cycle drafted (24 plain decoding cycles), so no tau" in text
    assert not re.search(r"tau \d|speedup \d", text)
    assert "the tree" not in text and "K=15 0.0%" in text


def test_auto_that_drafted_mostly_gives_no_plain_reason():
    from dflash_jax.generation import plain_reason

    s = job_summary("auto", 1, [[6, 7]], {0: 1, 15: 30}, {0: 4.0, 15: 6.0}, 0.8)
    assert "plain" not in s["speculation"] and s["speculation"]["reading"]["best"] == 15
    reading = dict(width=8, best=32, cycle_ms={"0": 4.0, "32": 40.0}, expected_tokens={"0": 1.0, "32": 5.0})
    why = plain_reason({"0": 0.9, "32": 0.1}, reading, tree_budget=32)
    assert "the tree (32 nodes): a 33-token verify cost 10.0 plain steps for 5.00 tokens a cycle" in why
    assert "its last reading favours the tree (32 nodes)" in why


def test_a_rows_tau_is_over_its_drafting_cycles():
    plain = {**RECORD, "acceptance_lengths": [3, 1], "plain_cycles": 5}
    assert readable_record(plain, "").startswith("--- r: 2 tokens (length, tau 2.00 over 2 drafting cycles, 5 plain)")
    never = {**RECORD, "acceptance_lengths": [], "plain_cycles": 5}
    assert readable_record(never, "").startswith("--- r: 2 tokens (length, 5 plain cycles, none drafted)")
    assert "tau" not in readable_record({**RECORD, "acceptance_lengths": [1, 1]}, "")  # plain decoding (block 1)
