"""`infer.job_output`: what a terminal shows of a row (no model needed)."""

import contextlib
import errno
import io
import json

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
