"""`python -m infer`: the JSONL contract, resume, stop tokens, chat inputs, bad input; the library
API beneath it (`GenerationJob`, `run_job`)."""

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from dflash_jax.checkpoint import DRAFTER_TABLE, save_hf_params
from dflash_jax.drafter import DrafterConfig, init_drafter_params
from dflash_jax import load_target
from dflash_jax.engine import BatchEngine
from dflash_jax.families import model_config_from_json
from fixtures import tiny
from infer.cli import EXIT_ROW_ERRORS, main
from tiny import make_model, save_model

FIELDS = ["id", "output_ids", "acceptance_lengths", "num_output_tokens", "finish_reason", "fingerprint"]


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ----------------------------------------------------------------------------- the reference pair


# One draft length throughout: for the tests of what speculation does not touch (row errors, stop
# tokens, resume, input forms), which then compile one cycle program, not auto's four. Auto runs
# end to end in the library API's test and the sampled row-limit test (tokens unchanged whichever K runs).
FIXED = ["--speculation", "fixed"]


def tiny_pair(max_new_tokens=40):
    """The parity fixture's pair on its greedy cases' prompts (its prompts.jsonl), verifying the whole
    block every cycle as the reference does (`--speculation fixed`: its acceptance lengths)."""
    return ["--target", str(tiny() / "target"), "--drafter", str(tiny() / "drafter"),
            "--input", str(tiny() / "prompts.jsonl"), "--max-new-tokens", str(max_new_tokens),
            "--speculation", "fixed"]


def test_tiny_pair_reproduces_the_reference(tmp_path, capsys):
    out, summary = tmp_path / "out.jsonl", tmp_path / "summary.json"
    assert main(tiny_pair() + ["--output", str(out), "--summary-json", str(summary)]) == 0
    err = capsys.readouterr().err
    assert "tau" in err and "tokens/s" in err and "bundled demo pair" not in err
    records = read_jsonl(out)
    cases = json.loads((tiny() / "greedy_cases.json").read_text())
    assert sorted(r["id"] for r in records) == [f"demo-{i}" for i in range(8)]
    for r in records:
        assert list(r) == FIELDS  # no tokenizer in the tiny pair: no text
        i = int(r["id"].split("-")[1])
        assert cases["prompts"][i] + r["output_ids"] == cases["outputs"][i]
        assert r["acceptance_lengths"] == cases["acceptance_lengths"][i]
        assert r["num_output_tokens"] == 40 and r["finish_reason"] == "length"
    s = json.loads(summary.read_text())
    all_acc = [a for r in records for a in r["acceptance_lengths"]]
    assert s["tau"] == pytest.approx(np.mean(all_acc), abs=1e-3)
    assert s["cycles"] == len(all_acc) and s["output_tokens"] == 320
    assert sum(s["acceptance_histogram"].values()) == len(all_acc)


def test_resume_skips_written_ids_and_repairs_a_torn_line(tmp_path, capsys):
    full = tmp_path / "full.jsonl"
    assert main(tiny_pair() + ["--output", str(full), "--quiet"]) == 0
    by_id = {r["id"]: r for r in read_jsonl(full)}

    partial = tmp_path / "partial.jsonl"
    kept = [dict(by_id["demo-3"], output_ids=[-7]), by_id["demo-5"]]  # a marker proves no rerun
    partial.write_text("".join(json.dumps(r) + "\n" for r in kept) + '{"id": "demo-1", "output_')
    assert main(tiny_pair() + ["--output", str(partial), "--quiet"]) == 0
    records = read_jsonl(partial)  # every line parses: the torn line is gone
    assert sorted(r["id"] for r in records) == sorted(by_id)
    got = {r["id"]: r for r in records}
    assert got["demo-3"]["output_ids"] == [-7]
    for i in by_id:
        if i != "demo-3":
            assert got[i] == by_id[i]
    # Nothing left to do: a third run adds nothing, and says so even with --quiet (no empty summary).
    capsys.readouterr()
    assert main(tiny_pair() + ["--output", str(partial), "--quiet"]) == 0
    assert len(read_jsonl(partial)) == 8
    err = capsys.readouterr().err
    assert "all 8 rows already done, nothing to generate" in err and "tau" not in err


@pytest.mark.heavy  # the everyday suite's row-limit test runs --compare-baseline too
def test_compare_baseline_reports_speedup(tmp_path):
    summary = tmp_path / "s.json"
    assert main(tiny_pair(16) + ["--output", str(tmp_path / "o.jsonl"), "--compare-baseline",
                                 "--summary-json", str(summary), "--quiet"]) == 0
    s = json.loads(summary.read_text())
    assert s["baseline"]["block_size"] == 1 and s["baseline"]["tau"] == 1.0
    assert s["baseline"]["output_tokens"] == s["output_tokens"] == 8 * 16
    assert s["speedup"] == pytest.approx(s["tokens_per_second"] / s["baseline"]["tokens_per_second"], rel=1e-2)


@pytest.mark.heavy  # the engine's K-drafts tests run everyday
def test_draft_tokens_verify_fewer_drafts_with_the_same_rows(tmp_path, capsys):
    """--draft-tokens 2 on the reference pair (block 8): the same tokens as the reference, no
    cycle longer than 3, the summary says so; a K outside 1..7 is a one-line error; the output
    directory is created."""
    out, summary = tmp_path / "new" / "out.jsonl", tmp_path / "s.json"
    assert main(tiny_pair() + ["--output", str(out), "--summary-json", str(summary), "--draft-tokens", "2"]) == 0
    err = capsys.readouterr().err
    assert "block size 8 (2 drafts verified per drafting cycle): tau" in err
    cases = json.loads((tiny() / "greedy_cases.json").read_text())
    records = read_jsonl(out)
    for r in records:
        i = int(r["id"].split("-")[1])
        assert cases["prompts"][i] + r["output_ids"] == cases["outputs"][i]
        assert max(r["acceptance_lengths"]) <= 3
    assert max(a for r in records for a in r["acceptance_lengths"]) == 3
    s = json.loads(summary.read_text())
    assert s["draft_tokens"] == 2 and s["block_size"] == 8 and sorted(s["acceptance_histogram"]) == ["1", "2", "3"]
    code = main(tiny_pair() + ["--output", str(tmp_path / "o2.jsonl"), "--draft-tokens", "8", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "--draft-tokens 8 is more than a block of 8 holds (1..7)" in err and err.count("\n") == 1, err
    code = main(tiny_pair() + ["--block-size", "1", "--draft-tokens", "2", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "--draft-tokens needs a drafter" in err and err.count("\n") == 1, err


def test_stop_tokens_come_from_the_generation_config(tmp_path):
    target = tmp_path / "target"
    shutil.copytree(tiny() / "target", target)
    prompts = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "input_ids": [5, 6, 7, 8]}])
    common = FIXED + ["--target", str(target), "--drafter", str(tiny() / "drafter"), "--input", str(prompts),
                      "--max-new-tokens", "30", "--quiet"]
    assert main(common + ["--output", str(tmp_path / "a.jsonl")]) == 0
    plain = read_jsonl(tmp_path / "a.jsonl")[0]["output_ids"]
    stop = plain[6]
    cut = plain[:plain.index(stop) + 1]
    gen_cfg = json.loads((target / "generation_config.json").read_text())
    (target / "generation_config.json").write_text(json.dumps({**gen_cfg, "eos_token_id": [999, stop]}))
    assert main(common + ["--output", str(tmp_path / "b.jsonl")]) == 0
    r = read_jsonl(tmp_path / "b.jsonl")[0]
    assert r["output_ids"] == cut and r["finish_reason"] == "stop" and r["num_output_tokens"] == len(cut)
    assert main(common + ["--output", str(tmp_path / "c.jsonl"), "--ignore-eos"]) == 0
    assert read_jsonl(tmp_path / "c.jsonl")[0]["output_ids"] == plain


def test_the_library_api_runs_a_job_and_resumes_it(tmp_path):
    """`run_job(GenerationJob(...))`, no flags: the reference pair's rows (shaped by
    train.generate_data's conversation_record) in the output, the summary returned; a rerun
    finds every row done and runs nothing."""
    from dflash_jax.generation import GenerationJob, run_job
    from train.generate_data import conversation_record

    out = tmp_path / "new" / "conversations.jsonl"
    job = GenerationJob.of(target=tiny() / "target", drafter=tiny() / "drafter", input=tiny() / "prompts.jsonl",
                        output=out, max_new_tokens=40, quiet=True)
    result = run_job(job, make_record=conversation_record)
    s = result.summary
    assert result.skipped == 0 and result.sample is None
    assert s["rows"] == 8 and s["errors"] == 0 and s["output_tokens"] == 320 and s["block_size"] == 8
    # Auto speculation (the default): the rows' plain cycles are counted apart from those that drafted,
    # whose tau is the summary's, exactly where the policy ran plain decoding.
    spec = s["speculation"]
    assert spec["mode"] == "auto" and spec["candidates"] == [0, 3, 7] and spec["reading"]["width"] == 8
    assert (s["plain_cycles"] > 0) == (spec["cycles"]["0"] > 0) and s["cycles"] + s["plain_cycles"] > 0
    assert sum(s["acceptance_histogram"].values()) == s["cycles"]
    assert (s["tau"] is None) == (s["cycles"] == 0)
    cases = json.loads((tiny() / "greedy_cases.json").read_text())
    records = read_jsonl(out)
    assert sorted(r["id"] for r in records) == [f"demo-{i}" for i in range(8)]
    for r in records:
        assert list(r) == ["id", "prompt_ids", "response_ids", "finish_reason", "fingerprint"]  # no tokenizer: ids only
        i = int(r["id"].split("-")[1])
        assert r["prompt_ids"] + r["response_ids"] == cases["outputs"][i] and r["prompt_ids"] == cases["prompts"][i]
    again = run_job(job, make_record=conversation_record)
    assert again.summary is None and again.skipped == 8 and len(read_jsonl(out)) == 8


def test_a_draft_tree_gives_the_references_rows_in_fewer_cycles(tmp_path, capsys):
    """--tree-budget 12 on the reference pair (block 8): the reference's tokens (the target's own
    greedy ones), more tokens per cycle than its chain, the summary says so; a rerun with the chain
    does not resume the tree's lines; bad combinations are one-line errors before anything loads."""
    out, summary = tmp_path / "out.jsonl", tmp_path / "s.json"
    assert main(tiny_pair() + ["--output", str(out), "--summary-json", str(summary), "--tree-budget", "12"]) == 0
    err = capsys.readouterr().err
    assert "block size 8 (a draft tree of 12 nodes verified per drafting cycle): tau" in err
    cases = json.loads((tiny() / "greedy_cases.json").read_text())
    records = read_jsonl(out)
    for r in records:
        i = int(r["id"].split("-")[1])
        assert cases["prompts"][i] + r["output_ids"] == cases["outputs"][i]
        assert r["fingerprint"]["tree_budget"] == 12
    s = json.loads(summary.read_text())
    chain_tau = np.mean([a for acc in cases["acceptance_lengths"] for a in acc])
    assert s["tree_budget"] == 12 and s["tau"] > chain_tau, (s["tau"], chain_tau)
    code = main(tiny_pair() + ["--output", str(out), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "was generated with --tree-budget 12, this run has 0" in err, err
    for flags, message in ((["--tree-budget", "4", "--draft-tokens", "3"], "--tree-budget and --draft-tokens exclude"),
                           (["--tree-budget", "4", "--block-size", "1"], "--tree-budget needs a drafter"),
                           (["--tree-budget", "-1"], "--tree-budget must be an integer >= 0")):
        code = main(tiny_pair() + flags + ["--quiet"])
        err = capsys.readouterr().err
        assert code == 2 and message in err and err.count("\n") == 1, (flags, err)


def test_a_job_with_a_bad_field_is_refused_naming_it():
    from dflash_jax.errors import InputError
    from dflash_jax.generation import GenerationJob

    target = dict(target=tiny() / "target", input=tiny() / "prompts.jsonl")
    for fields, message in ((dict(batch_size=0), "--batch-size must be >= 1, got 0"),
                            (dict(page_size="8"), "--page-size must be an integer, got '8'"),
                            (dict(stall_timeout=-1.0), "--stall-timeout must be >= 0"),
                            (dict(dtype="float16"), "--dtype must be one of bfloat16, float32, got 'float16'"),
                            (dict(block_size=1, draft_tokens=2), "--draft-tokens needs a drafter"),
                            (dict(input=None), "--input is required when --target is given")):
        with pytest.raises(InputError, match=message):
            GenerationJob.of(**{**target, **fields})
    assert GenerationJob().resolved().options.max_new_tokens == 128 and GenerationJob().resolved().compare_baseline


# ----------------------------------------------------------------------------- chat inputs

WORDS = [f"w{i}" for i in range(150)] + ["user", "assistant", "system"]
TEMPLATE = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
            "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")


@pytest.fixture(scope="module")
def chat_pair(tmp_path_factory):
    """A tiny random target with a word-level tokenizer and chat template, and a random drafter."""
    root = tmp_path_factory.mktemp("chat")
    target = save_model(make_model("qwen3", seed=7), root / "target")
    vocab = {t: i for i, t in enumerate(["<pad>", "<unk>", "</s>", "<|im_start|>", "<|im_end|>"] + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(target)
    tcfg = model_config_from_json(target / "config.json")
    dcfg = DrafterConfig(model=tcfg.replace(num_hidden_layers=1, sliding_windows=(None,), qk_norm=True),
                         block_size=4, mask_token_id=1, target_layer_ids=(1, 2), num_target_layers=4)
    drafter = root / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text(json.dumps(dcfg.to_hf_dict()))
    save_hf_params(init_drafter_params(dcfg, jax.random.PRNGKey(1)), drafter / "model.safetensors", table=DRAFTER_TABLE)
    return target, drafter, fast


def test_prompt_messages_turns_and_input_ids(chat_pair, tmp_path):
    target, drafter, tokenizer = chat_pair
    rows = [
        {"id": "p", "prompt": "w1 w2 w3"},
        {"id": "m", "messages": [{"role": "system", "content": "w9"}, {"role": "user", "content": "w4 w5"}]},
        {"id": "t", "turns": ["w6 w7", "w8"]},
        {"input_ids": [10, 11, 12]},
    ]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    assert main(FIXED + ["--target", str(target), "--drafter", str(drafter), "--input", str(inp), "--output", str(out),
                         "--max-new-tokens", "6", "--ignore-eos", "--quiet", "--batch-size", "2"]) == 0
    got = {r["id"]: r for r in read_jsonl(out)}
    assert set(got) == {"p", "m", "t", 4}  # a row without id is named by its line number
    for r in got.values():
        assert r["num_output_tokens"] == 6 and r["text"] == tokenizer.decode(r["output_ids"], skip_special_tokens=True)

    tcfg, tparams = load_target(target)
    plain = BatchEngine(tcfg, tparams, max_new_tokens=6, max_prompt_len=64, batch_size=1)
    first = lambda ids: next(plain.generate([ids])).output_ids
    assert got["p"]["output_ids"] == first(tokenizer("w1 w2 w3")["input_ids"])
    msgs = rows[1]["messages"]
    assert got["m"]["output_ids"] == first(list(tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)["input_ids"]))
    assert got[4]["output_ids"] == first([10, 11, 12])
    # turns: the first answer joins the conversation before the second user turn.
    t = got["t"]
    assert len(t["turns"]) == 2 and t["output_ids"] == t["turns"][1]["output_ids"]
    conv = [{"role": "user", "content": "w6 w7"}]
    assert t["turns"][0]["output_ids"] == first(list(tokenizer.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)["input_ids"]))
    conv += [{"role": "assistant", "content": t["turns"][0]["text"]}, {"role": "user", "content": "w8"}]
    assert t["output_ids"] == first(list(tokenizer.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)["input_ids"]))


# ----------------------------------------------------------------------------- bad input


def run_cli(args):
    proc = subprocess.run([sys.executable, "-m", "infer", *args], capture_output=True, text=True)
    return proc.returncode, proc.stderr


@pytest.mark.parametrize("lines, message", [
    (['{"input_ids": [1, 2]}', "{not json"],
     "in.jsonl line 2 column 2: not valid JSON (Expecting property name enclosed in double quotes)"),
    (['{"prompt": "a\tb"}'], "in.jsonl line 1 column 14: not valid JSON (Invalid control character)"),
    ([], "in.jsonl holds no rows"),
    (['{"input_ids": [1, 2]}', '{"input_ids": [3, 600]}'],
     "in.jsonl line 2: token id 600 is outside the target's vocabulary (0..511)"),
    (['[1, 2]'], "line 1: expected a JSON object"),
    (['{"id": 1}'], "line 1: needs exactly one of input_ids, prompt, messages, turns"),
    (['{"input_ids": [1, "a"]}'], "line 1: input_ids must be a non-empty list of integers"),
    (['{"id": 1, "input_ids": [1]}', '{"id": 1, "input_ids": [2]}'], "line 2: duplicate id 1"),
    (['{"prompt": "hello"}'], "'prompt' needs a tokenizer"),
    (['{"question": "hello"}'], "in.jsonl line 1: needs exactly one of input_ids, prompt, messages, turns "
                                "(unknown key 'question')"),
    (['{"promt": "hello"}'], "in.jsonl line 1: unknown key 'promt' (did you mean 'prompt'?)"),
])
def test_malformed_input_is_a_one_line_error(lines, message, tmp_path, capsys, monkeypatch):
    """... naming the file as given and the line, before a weight is read (so before any compile)."""
    import dflash_jax.checkpoint

    def no_loading(*a, **kw):
        raise AssertionError("a model was loaded before the input was checked")

    monkeypatch.setattr(dflash_jax.checkpoint, "load_model", no_loading)
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(line + "\n" for line in lines))
    out = tmp_path / "out.jsonl"
    code = main(["--target", str(tiny() / "target"), "--drafter", str(tiny() / "drafter"),
                 "--input", str(inp), "--output", str(out), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1, err
    assert message.split(" ")[0] != "in.jsonl" or str(inp) in err  # the whole path, as given
    assert not out.exists() or out.read_text() == ""


def test_flag_ranges_are_checked_before_any_model_loads(tmp_path, capsys):
    """The target does not exist: a bad flag must be what the error names."""
    inp = write_jsonl(tmp_path / "in.jsonl", [{"input_ids": [1, 2]}])
    for flag, value in (("--block-size", "0"), ("--draft-tokens", "0"), ("--max-prompt-len", "0"),
                        ("--batch-size", "-1"), ("--sync-every", "0"), ("--top-p", "0"), ("--kv-pages", "0"),
                        ("--page-size", "0")):
        code = main(["--target", str(tmp_path / "nope"), "--drafter", str(tmp_path / "nope"),
                     "--input", str(inp), flag, value, "--quiet"])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and "does not exist" not in err, (flag, err)
        assert flag.lstrip("-").replace("-", "_") in err.replace("-", "_"), (flag, err)


def test_unknown_keys_are_named_and_plain_decoding_prints_no_acceptance(tmp_path, capsys):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"input_ids": [1, 2], "answer": "x"}, {"input_ids": [3], "answer": 1}])
    out = tmp_path / "out.jsonl"
    assert main(["--target", str(tiny() / "target"), "--input", str(inp), "--output", str(out),
                 "--max-new-tokens", "3"]) == 0
    err = capsys.readouterr().err
    assert err.count("unknown key 'answer' ignored") == 1 and f"{inp} line 1" in err
    assert len(read_jsonl(out)) == 2
    assert "plain autoregressive decoding (block size 1)" in err
    assert "tau" not in err and "histogram" not in err


def test_a_terminal_gets_readable_rows_and_a_pipe_json():
    from dflash_jax.generation import InputRow
    from infer.job_output import Writer, readable_record

    record = {"id": "a", "output_ids": [5, 6], "text": "    return n", "acceptance_lengths": [1, 3],
              "num_output_tokens": 2, "finish_reason": "length"}
    text = readable_record(record, "def f(n):\n")
    assert text == "--- a: 2 tokens (length, tau 2.00)\ndef f(n):\n>>>    return n\n\n"
    assert readable_record({"id": "b", "error": "line 2: empty prompt"}, None) == "--- b: error: line 2: empty prompt\n"

    class Stream(io.StringIO):
        def __init__(self, tty):
            super().__init__()
            self.tty = tty

        def isatty(self):
            return self.tty

    for tty in (True, False):
        stream = Stream(tty)
        with contextlib.redirect_stdout(stream):
            Writer(None).write(record, InputRow("a", 1, "prompt", "def f(n):\n"))
        assert stream.getvalue() == (text if tty else json.dumps(record) + "\n")


def test_missing_files_and_incompatible_drafter(tmp_path, capsys):
    # The real command once (its stderr is the one line, nothing from the imports); the rest in-process.
    code, err = run_cli(["--target", str(tmp_path / "nope"), "--input", str(tmp_path / "x.jsonl")])
    assert code == 2 and "does not exist" in err and err.count("\n") == 1

    def cli(args):
        code = main(args)
        return code, capsys.readouterr().err

    write_jsonl(tmp_path / "in.jsonl", [{"input_ids": [1, 2]}])
    code, err = cli(["--target", str(tiny() / "target"), "--input", str(tmp_path / "in.jsonl"),
                     "--drafter", str(tmp_path / "nope")])
    assert code == 2 and "nope does not exist" in err
    bad = tmp_path / "drafter"
    shutil.copytree(tiny() / "drafter", bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["dflash_config"]["target_layer_ids"] = [1, 7]
    (bad / "config.json").write_text(json.dumps(cfg))
    code, err = cli(["--target", str(tiny() / "target"), "--drafter", str(bad), "--input", str(tmp_path / "in.jsonl")])
    assert code == 2 and "taps target layers [7], but the target has 6 layers" in err and err.count("\n") == 1, err
    code, err = cli(["--drafter", str(tiny() / "drafter")])
    assert code == 2 and "--drafter needs --target" in err


def test_too_long_prompt_is_a_row_error_and_other_rows_complete(tmp_path, capsys):
    rows = [{"id": "ok", "input_ids": [1, 2, 3]}, {"id": "long", "input_ids": [5] * 140}, {"id": "ok2", "input_ids": [4]}]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    # The settings of test_row_limits_and_a_large_cache_give_the_same_rows: the same compiled programs.
    common = FIXED + ["--target", str(tiny() / "target"), "--drafter", str(tiny() / "drafter"), "--input", str(inp),
                      "--output", str(out), "--max-new-tokens", "24", "--batch-size", "2", "--ignore-eos", "--quiet"]
    assert main(common + ["--max-prompt-len", "128"]) == EXIT_ROW_ERRORS
    got = {r["id"]: r for r in read_jsonl(out)}
    assert got["long"]["error"] == "line 2: prompt of 140 tokens is longer than the context (128 tokens)"
    assert got["ok"]["num_output_tokens"] == 24 and got["ok2"]["num_output_tokens"] == 24
    # An error row is retried on resume (it is not counted as done).
    assert main(common + ["--max-prompt-len", "256"]) == 0
    assert read_jsonl(out)[-1]["id"] == "long" and read_jsonl(out)[-1]["num_output_tokens"] == 24


@pytest.mark.heavy
def test_a_page_pool_reproduces_the_reference_and_refuses_what_it_cannot_hold(tmp_path, capsys):
    """--kv-pages: the reference pair's rows through a pool of 12 pages of 16 positions (per-row
    caches would take 8 x 208), the same tokens as the reference; a row longer than the whole pool
    is a row error naming the pages, and the other rows complete."""
    rows = read_jsonl(tiny() / "prompts.jsonl") + [{"id": "long", "input_ids": [5] * 150}]
    out = tmp_path / "out.jsonl"
    args = tiny_pair()
    args[args.index("--input") + 1] = str(write_jsonl(tmp_path / "in.jsonl", rows))
    assert main(args + ["--output", str(out), "--kv-pages", "12", "--page-size", "16", "--quiet"]) == EXIT_ROW_ERRORS
    got = {r["id"]: r for r in read_jsonl(out)}
    assert got.pop("long")["error"] == ("line 9: needs 13 pages of 16 positions (150 prompt tokens + 40 new + "
                                        "7 drafts); the pool has 12: raise kv_pages")
    cases = json.loads((tiny() / "greedy_cases.json").read_text())
    assert len(got) == len(rows) - 1
    for r in got.values():
        i = int(r["id"].split("-")[1])
        assert cases["prompts"][i] + r["output_ids"] == cases["outputs"][i]


@pytest.mark.parametrize("sampled,large", [(False, False), pytest.param(False, True, marks=pytest.mark.heavy),
                                           pytest.param(True, False, marks=pytest.mark.heavy)])
def test_row_limits_and_a_large_cache_give_the_same_rows(sampled, large, tmp_path):
    """Rows carrying their own max_new_tokens get exactly that many tokens, the first tokens of the
    full-length run (greedy and sampled: keys are per row and position); (sampled) the baseline runs
    the same rows with the same limits; (large) a cache sized for 2048-token prompts gives the same
    rows as one sized for 128; a too-long prompt is still a row error; a row asking for more than
    --max-new-tokens is a one-line error before any model loads."""
    rng = np.random.default_rng(0)
    vocab = json.loads((tiny() / "target" / "config.json").read_text())["vocab_size"]
    lengths = [5, 30, 3, 20, 12, 29, 7, 25, 200]  # two prompt buckets (few compilations) and one too long
    limits = [None, 3, 24, 1, 10, None, 17, 5, 8]
    rows = [{"id": f"r{i}", "input_ids": rng.integers(1, vocab, n).tolist()} for i, n in enumerate(lengths)]
    full = write_jsonl(tmp_path / "full.jsonl", rows)
    limited = write_jsonl(tmp_path / "limited.jsonl", [
        {**r, "max_new_tokens": m} if m else r for r, m in zip(rows, limits)])
    common = ["--target", str(tiny() / "target"), "--drafter", str(tiny() / "drafter"),
              "--max-new-tokens", "24", "--batch-size", "2", "--ignore-eos"] + (FIXED if not sampled else [])
    if sampled:
        common += ["--temperature", "0.8", "--top-k", "20", "--seed", "3"]
    outs = {name: tmp_path / f"out-{name}.jsonl" for name in ("full", "limited", "large")}
    assert main(common + ["--input", str(full), "--output", str(outs["full"]), "--max-prompt-len", "128",
                          "--quiet"]) == EXIT_ROW_ERRORS
    summary = tmp_path / "s.json"
    baseline = ["--compare-baseline"] if sampled else []  # a second engine: in the heavy variant
    assert main(common + ["--input", str(limited), "--output", str(outs["limited"]), "--max-prompt-len", "128",
                          *baseline, "--summary-json", str(summary), "--quiet"]) == EXIT_ROW_ERRORS
    if large:
        assert main(common + ["--input", str(full), "--output", str(outs["large"]), "--max-prompt-len", "2048",
                              "--quiet"]) == 0
    got = {name: {r["id"]: r for r in read_jsonl(path)} for name, path in outs.items() if path.exists()}
    assert got["full"]["r8"]["error"] == "line 9: prompt of 200 tokens is longer than the context (128 tokens)"
    if large:
        assert got["large"]["r8"]["num_output_tokens"] == 24  # the large cache holds it
        # Tokens, not acceptance lengths: under auto speculation those depend on the K each cycle ran
        tokens = lambda rows: {k: (v["output_ids"], v["finish_reason"]) for k, v in rows.items() if k != "r8"}
        assert tokens(got["large"]) == tokens(got["full"])
    for i, limit in enumerate(limits[:8]):
        a, b = got["full"][f"r{i}"], got["limited"][f"r{i}"]
        n = limit or 24
        assert b["output_ids"] == a["output_ids"][:n] and b["num_output_tokens"] == n
        assert b["finish_reason"] == "length"
    s = json.loads(summary.read_text())
    expected = sum(m or 24 for m in limits[:8])
    assert s["output_tokens"] == expected and s["errors"] == 1
    if sampled:  # the baseline runs the same rows with the same limits
        assert s["baseline"]["output_tokens"] == expected
        return
    write_jsonl(tmp_path / "over.jsonl", [{"input_ids": [1, 2], "max_new_tokens": 25}])
    code, err = run_cli(common + ["--input", str(tmp_path / "over.jsonl")])
    assert code == 2 and "over.jsonl line 1: max_new_tokens 25 is more than --max-new-tokens 24" in err
    write_jsonl(tmp_path / "zero.jsonl", [{"input_ids": [1, 2], "max_new_tokens": 0}])
    code, err = run_cli(common + ["--input", str(tmp_path / "zero.jsonl")])
    assert code == 2 and "zero.jsonl line 1: max_new_tokens must be an integer in 1..2147483647, got 0" in err


def test_every_flag_has_help_and_shows_its_default():
    from infer.cli import build_parser

    parser = build_parser()
    formatter = parser._get_formatter()
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        text = formatter._get_help_string(action) % {"default": action.default}
        assert action.help, action.option_strings
        if action.default is not None and action.default is not False:  # a default worth showing
            assert "default" in text, (action.option_strings, text)
    help_text = " ".join(parser.format_help().split())
    assert "0 = greedy (default: 0.0)" in help_text and "finish) (default: 8)" in help_text


# ----------------------------------------------------------------------------- resume, bad files, exit codes


def refuse_to_load(monkeypatch):
    """Make loading a model fail the test: what is checked must be checked before."""
    import dflash_jax.checkpoint as checkpoint

    def no(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(checkpoint, "load_target", no)
    monkeypatch.setattr(checkpoint, "load_drafter", no)


def test_resume_takes_only_this_runs_rows(tmp_path, capsys, monkeypatch):
    """The newcomer's mix-up: A's 2 rows into AB.jsonl, then B's 3 rows (ids are line numbers)
    into the same file used to skip B's first two rows as done. Each line now carries its input
    line's digest and the run's settings: another input, other settings, a line from another
    tool, or the input itself as the output is a one-line error naming the line and --overwrite,
    before a model loads; --overwrite starts over; the same run resumes."""
    a = write_jsonl(tmp_path / "A.jsonl", [{"input_ids": [1, 2, 3]}, {"input_ids": [5, 6]}])
    b = write_jsonl(tmp_path / "B.jsonl", [{"input_ids": [7, 8, 3]}, {"input_ids": [9, 6]}, {"input_ids": [4]}])
    out = tmp_path / "AB.jsonl"
    # The settings of test_too_long_prompt_is_a_row_error_and_other_rows_complete: its programs.
    common = FIXED + ["--target", str(tiny() / "target"), "--drafter", str(tiny() / "drafter"), "--output", str(out),
                      "--max-new-tokens", "24", "--batch-size", "2", "--ignore-eos", "--max-prompt-len", "128",
                      "--quiet"]
    assert main(common + ["--input", str(a)]) == 0
    first = read_jsonl(out)
    assert {r["id"] for r in first} == {1, 2}
    fp = first[0]["fingerprint"]
    assert fp["temperature"] == 0.0 and fp["block_size"] == 8 and fp["max_new_tokens"] == 24 and fp["input"]
    capsys.readouterr()

    refuse_to_load(monkeypatch)
    cases = [
        (["--input", str(b)], "was generated from another row than"),
        (["--input", str(a), "--temperature", "0.5"], "was generated with --temperature 0.0, this run has 0.5"),
        (["--input", str(a), "--seed", "1"], "was generated with --seed 0, this run has 1"),
        (["--input", str(a), "--max-new-tokens", "16"], "was generated with --max-new-tokens 24, this run has 16"),
        (["--input", str(a), "--draft-tokens", "3"], "was generated with --draft-tokens 7, this run has 3"),
        (["--input", str(a), "--block-size", "1"], "was generated with a drafter"),
    ]
    for extra, message in cases:
        code = main(common + extra)
        err = capsys.readouterr().err
        assert code == 2 and message in err and err.count("\n") == 1, (extra, err)
        assert f"{out} line 1" in err and "--overwrite" in err, err
    assert read_jsonl(out) == first  # nothing was written

    # A line from elsewhere (no fingerprint), and an id the input does not have.
    other = write_jsonl(tmp_path / "other.jsonl", [{"id": 1, "output_ids": [3]}])
    code = main(common[:-10] + ["--output", str(other), "--input", str(a), "--quiet"])
    assert code == 2 and "other.jsonl line 1 has no fingerprint" in capsys.readouterr().err
    extra_id = write_jsonl(tmp_path / "extra.jsonl", [dict(first[0], id="zz")])
    code = main(common[:-10] + ["--output", str(extra_id), "--input", str(a), "--quiet"])
    assert code == 2 and "id 'zz' is not a row of" in capsys.readouterr().err
    # The input as its own output.
    code = main(common[:-10] + ["--output", str(a), "--input", str(a), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "is the input file" in err and err.count("\n") == 1
    assert len(read_jsonl(a)) == 2
    monkeypatch.undo()

    # --overwrite starts over with B; then the same run resumes (nothing to do).
    assert main(common + ["--input", str(b), "--overwrite"]) == 0
    got = read_jsonl(out)
    assert sorted(r["id"] for r in got) == [1, 2, 3] and all(r["fingerprint"]["input"] != fp["input"] for r in got)
    capsys.readouterr()
    assert main(common + ["--input", str(b)]) == 0
    assert "all 3 rows already done" in capsys.readouterr().err and len(read_jsonl(out)) == 3


def test_bad_files_and_flags_are_one_line_errors_before_anything_loads(tmp_path, capsys, monkeypatch):
    """Input that is not UTF-8, a directory as input or output, an output under a file, a missing
    drafter (named as the drafter), --draft-tokens past the drafter's block, a misspelt row key
    (did you mean): exit status 2, one line, no model loaded."""
    refuse_to_load(monkeypatch)
    good = write_jsonl(tmp_path / "in.jsonl", [{"input_ids": [1, 2]}])
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"input_ids": [1]}\n{"prompt": "caf\xe9"}\n')
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("")
    misspelt = write_jsonl(tmp_path / "typo.jsonl", [{"input_ids": [1], "temprature": 0.7}])
    bad_value = write_jsonl(tmp_path / "bad.jsonl", [{"input_ids": [1], "top_p": 0}])
    pair = ["--target", str(tiny() / "target"), "--drafter", str(tiny() / "drafter")]
    cases = [
        (["--input", str(latin)], "latin.jsonl line 2 column 16: not UTF-8 text (byte 0xe9)"),
        (["--input", str(tmp_path / "adir")], "adir is a directory, not a JSONL file"),
        (["--input", str(good), "--output", str(tmp_path / "adir")], "adir is a directory; give a file name"),
        (["--input", str(good), "--output", str(tmp_path / "afile" / "o.jsonl")], "afile is a file, not a directory"),
        (["--input", str(good), "--draft-tokens", "20"], "--draft-tokens 20 is more than a block of 8 holds (1..7)"),
        (["--input", str(misspelt)], "unknown key 'temprature' (did you mean 'temperature'?)"),
        (["--input", str(bad_value)], "bad.jsonl line 1: top_p must be a number in (0, 1] (from 1.2e-38 up), got 0"),
    ]
    for extra, message in cases:
        code = main(pair + extra + ["--quiet"])
        err = capsys.readouterr().err
        assert code == 2 and message in err and err.count("\n") == 1, (extra, err)
    code = main(["--target", str(tiny() / "target"), "--drafter", str(tmp_path / "nope"), "--input", str(good)])
    err = capsys.readouterr().err
    assert code == 2 and f"drafter directory {tmp_path / 'nope'} does not exist" in err
    code = main(["--target", str(tmp_path / "nope"), "--input", str(good)])
    assert code == 2 and "target directory" in capsys.readouterr().err


def test_misspelt_keys_are_near_a_row_key_and_metadata_is_not():
    from dflash_jax.generation import misspelt_key

    assert misspelt_key("temprature") == "temperature" and misspelt_key("Top_P") == "top_p"
    assert misspelt_key("max_new_token") == "max_new_tokens" and misspelt_key("promt") == "prompt"
    assert misspelt_key("input_id") == "input_ids" and misspelt_key("messsages") == "messages"
    for metadata in ("idx", "task_id", "category", "answer", "text", "source", "label", "meta"):
        assert misspelt_key(metadata) is None, metadata


def test_rows_that_cannot_run_are_found_before_loading_and_exit_4(tmp_path, capsys, monkeypatch):
    """Every row longer than the target's context: each is an error line, found before a model
    loads (so no cache is sized for them), and the run exits 4 saying how many rows failed."""
    refuse_to_load(monkeypatch)
    context = json.loads((tiny() / "target" / "config.json").read_text())["max_position_embeddings"]
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": "long", "input_ids": [5] * (context + 1)},
                                              {"id": "long2", "input_ids": [6] * (context + 5)}])
    out = tmp_path / "out.jsonl"
    code = main(["--target", str(tiny() / "target"), "--input", str(inp), "--output", str(out)])
    err = capsys.readouterr().err
    assert code == EXIT_ROW_ERRORS and "error: 2 of 2 rows could not run" in err.splitlines()[-1], err
    got = {r["id"]: r for r in read_jsonl(out)}
    assert got["long"]["error"] == f"line 1: prompt of {context + 1} tokens is longer than the context ({context} tokens)"
    assert got["long2"]["fingerprint"]["input"]


def test_help_documents_resume_row_keys_and_exit_codes():
    from dflash_jax.generation import ROW_KEYS
    from infer.cli import build_parser

    text = " ".join(build_parser().format_help().split())
    for phrase in ("--overwrite", "resumes", "fingerprint", "did you mean", "DFLASH_COMPILE_CACHE", "Exit status",
                   "4 done, but some rows could not run", "temperature, top_p and top_k",
                   "5 the output could not be written", "locked", "exactly one of: prompt (text), input_ids"):
        assert phrase in text, phrase
    for key in ROW_KEYS:  # every key a row may have, each named
        assert f" {key} (" in text or f" {key}," in text or f" {key} and" in text, key


def test_numbers_the_engine_casts_are_bounded_before_anything_loads(tmp_path, capsys, monkeypatch):
    """top_k, max_new_tokens and token ids are int32 on the device, temperatures float32: a flag or
    row past what the engine holds is a one-line error (exit status 2) before a model loads, not an
    overflow traceback after. A seed is any integer (taken modulo 2**32)."""
    from dflash_jax.engine.sampling import seed_int32

    refuse_to_load(monkeypatch)
    good = write_jsonl(tmp_path / "in.jsonl", [{"input_ids": [1, 2]}])

    def raw(name, line):
        (tmp_path / name).write_text(line + "\n")
        return ["--input", str(tmp_path / name)]

    big = 2**31
    cases = [
        (["--input", str(good), "--top-k", str(big)], f"--top-k must be an integer in 0..{big - 1} (0: off), got {big}"),
        (["--input", str(good), "--max-new-tokens", str(big)], f"--max-new-tokens must be an integer in 1..{big - 1}"),
        (["--input", str(good), "--temperature", "nan"], "--temperature must be 0 (greedy) or a number from 1e-05 up, got NaN"),
        (["--input", str(good), "--temperature", "inf"], "--temperature must be 0 (greedy) or a number from 1e-05 up, got Infinity"),
        (["--input", str(good), "--temperature", "1e-9"], "--temperature must be 0 (greedy) or a number from 1e-05 up"),
        (raw("k.jsonl", f'{{"input_ids": [1], "top_k": {big}}}'), f"k.jsonl line 1: top_k must be an integer in "
                                                                   f"0..{big - 1} (0: off), got {big}"),
        (raw("m.jsonl", f'{{"input_ids": [1], "max_new_tokens": {big}}}'),
         f"m.jsonl line 1: max_new_tokens must be an integer in 1..{big - 1}, got {big}"),
        (raw("t.jsonl", '{"input_ids": [1], "temperature": Infinity}'),
         "t.jsonl line 1: temperature must be 0 (greedy) or a number from 1e-05 up, got Infinity"),
        (raw("i.jsonl", f'{{"input_ids": [1, {2**40}]}}'),
         f"i.jsonl line 1: token id {2**40} is outside the target's vocabulary (0..511)"),
    ]
    pair = ["--target", str(tiny() / "target"), "--drafter", str(tiny() / "drafter"), "--quiet"]
    for extra, message in cases:
        code = main(pair + extra)
        err = capsys.readouterr().err
        assert code == 2 and message in err and err.count("\n") == 1, (extra, err)
    # Seeds: any integer; the engine's int32 is the seed modulo 2**32 (the int32 range unchanged).
    assert [seed_int32(s) for s in (0, 5, -1, big - 1, -big)] == [0, 5, -1, big - 1, -big]
    assert seed_int32(big) == -big and seed_int32(2**32 + 5) == 5 and seed_int32(-(2**40) + 7) == 7
    assert np.int32(seed_int32(10**30)) == seed_int32(10**30 + 2**32)


@pytest.mark.heavy  # a sampled engine: one more compile
def test_seeds_a_multiple_of_2_to_the_32_apart_give_the_same_tokens(tmp_path):
    """--seed 2**32 + 3 runs (no int32 overflow) and samples the tokens --seed 3 does."""
    inp = write_jsonl(tmp_path / "in.jsonl", [{"input_ids": [5, 6, 7]}, {"input_ids": [9, 10]}])
    common = FIXED + ["--target", str(tiny() / "target"), "--drafter", str(tiny() / "drafter"), "--input", str(inp),
                      "--max-new-tokens", "12", "--temperature", "1.0", "--ignore-eos", "--quiet"]
    got = []
    for seed in (3, 2**32 + 3, 4):
        out = tmp_path / f"out-{seed}.jsonl"
        assert main(common + ["--seed", str(seed), "--output", str(out)]) == 0
        got.append([r["output_ids"] for r in read_jsonl(out)])
    assert got[0] == got[1] != got[2]


def fake_output(path, job, lines=None):
    """Lines that a run of `job` would resume (their fingerprints its own), written without running
    it: for each (row id, kind) of `lines` ("result" or "error"; default each row's result once)."""
    from dataclasses import replace

    from dflash_jax.generation import plan_job

    plan = plan_job(replace(job.resolved(), overwrite=True), lambda *a: None)  # (what the output holds aside)
    lines = lines if lines is not None else [(r.id, "result") for r in plan.rows]
    made = [{"id": i, **({"output_ids": [1]} if kind == "result" else {"error": "line 1: why"}),
             "fingerprint": {"input": plan.keys[i], **plan.settings}} for i, kind in lines]
    return write_jsonl(path, made)


def test_resume_refuses_a_row_written_twice_and_a_finished_run_still_writes_its_summary(tmp_path, capsys,
                                                                                        monkeypatch):
    """Two runs that wrote one output at once leave each row twice: a rerun names both lines (a row
    whose first line is an error was retried: not a duplicate). With every row already done,
    --summary-json is still written (no rows ran), and one line says so."""
    from dflash_jax.generation import GenerationJob

    refuse_to_load(monkeypatch)
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "input_ids": [1, 2]}, {"id": "b", "input_ids": [3]}])
    out, summary = tmp_path / "out.jsonl", tmp_path / "s.json"
    job = GenerationJob(target=tiny() / "target", input=inp, output=out)
    args = ["--target", str(tiny() / "target"), "--input", str(inp), "--output", str(out), "--quiet"]
    fake_output(out, job, [("a", "result"), ("b", "result"), ("a", "result"), ("b", "result")])
    code = main(args)
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert f"{out} lines 1 and 3 both hold the row of id 'a'" in err and "--overwrite" in err, err
    fake_output(out, job, [("a", "result"), ("b", "error"), ("a", "error")])
    code = main(args)
    assert code == 2 and f"{out} lines 1 and 3 both hold the row of id 'a'" in capsys.readouterr().err

    fake_output(out, job, [("a", "error"), ("b", "result"), ("a", "error"), ("a", "result")])  # retried twice
    assert main(args + ["--summary-json", str(summary)]) == 0
    assert capsys.readouterr().err == f"{out}: all 2 rows already done, nothing to generate\n"
    s = json.loads(summary.read_text())
    assert s["rows"] == 0 and s["errors"] == 0 and s["already_done"] == 2 and "nothing ran" in s["note"]


def too_long_rows(path):
    """Rows longer than the tiny target's context: a run writes their error lines without loading a model."""
    context = json.loads((tiny() / "target" / "config.json").read_text())["max_position_embeddings"]
    return write_jsonl(path, [{"id": "long", "input_ids": [5] * (context + 1)}])


def test_a_second_run_on_an_output_being_written_is_refused(tmp_path, capsys, monkeypatch):
    """The output is locked for a run (a lock file beside it, holding the pid): a second run on it,
    here or in another process, is one line and exit status 2 naming the holder's pid; once the
    first ends (even without releasing it, as a killed run), the output runs, and its lock file goes."""
    from dflash_jax.generation import OutputLock

    refuse_to_load(monkeypatch)
    inp, out = too_long_rows(tmp_path / "in.jsonl"), tmp_path / "out.jsonl"
    args = ["--target", str(tiny() / "target"), "--input", str(inp), "--output", str(out), "--quiet"]
    lock = out.with_name("out.jsonl.lock")
    holder = subprocess.Popen([sys.executable, "-c", "import sys; from pathlib import Path; from dflash_jax.generation "
                               f"import OutputLock; lock = OutputLock(Path({str(out)!r})); print('held', flush=True); "
                               "sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        code = main(args)
        err = capsys.readouterr().err
        assert code == 2 and err == (f"error: {out} is being written by another run (pid {holder.pid}); wait for it "
                                     f"to end, or choose another --output\n"), err
        assert not out.exists()
    finally:
        holder.communicate("")
    assert holder.returncode == 0 and lock.exists()  # it ended without releasing: its file stays, its lock not
    with OutputLock(out):  # in this process, as a run holds it
        assert main(args) == 2 and f"(pid {os.getpid()})" in capsys.readouterr().err
    assert main(args) == EXIT_ROW_ERRORS and len(read_jsonl(out)) == 1 and not lock.exists()


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_disk_is_one_line_and_exit_status_5(tmp_path, capsys, monkeypatch):
    """Every write to /dev/full fails with ENOSPC: the run says so in one line and exits 5."""
    from infer.cli import EXIT_WRITE_FAILED

    refuse_to_load(monkeypatch)
    inp, out = too_long_rows(tmp_path / "in.jsonl"), tmp_path / "out.jsonl"
    out.symlink_to("/dev/full")
    code = main(["--target", str(tiny() / "target"), "--input", str(inp), "--output", str(out), "--quiet"])
    err = capsys.readouterr().err
    assert code == EXIT_WRITE_FAILED == 5, err
    assert err == f"error: could not write {out}: No space left on device; the rows written are kept and a rerun " \
                  f"resumes\n", err
    assert not out.with_name("out.jsonl.lock").exists()


@pytest.mark.heavy  # a per-row sampling engine and a sampled one: two more compiles
def test_rows_set_their_own_sampling(tmp_path):
    """A row's own temperature / top_k in a greedy run gives that row exactly the tokens of a run
    sampled with those flags (keys are per row position and seed), and the other rows stay greedy."""
    rng = np.random.default_rng(1)
    rows = [{"id": f"r{i}", "input_ids": rng.integers(1, 400, 6 + i).tolist()} for i in range(3)]
    common = FIXED + ["--target", str(tiny() / "target"), "--drafter", str(tiny() / "drafter"), "--max-new-tokens",
                      "12", "--batch-size", "2", "--ignore-eos", "--seed", "3", "--quiet"]
    mixed = write_jsonl(tmp_path / "mixed.jsonl", [dict(rows[0], temperature=0.8, top_k=20), *rows[1:]])
    plain = write_jsonl(tmp_path / "plain.jsonl", rows)
    outs = {k: tmp_path / f"out-{k}.jsonl" for k in ("mixed", "sampled", "greedy")}
    assert main(common + ["--input", str(mixed), "--output", str(outs["mixed"])]) == 0
    assert main(common + ["--input", str(plain), "--output", str(outs["sampled"]), "--temperature", "0.8",
                          "--top-k", "20"]) == 0
    assert main(common + ["--input", str(plain), "--output", str(outs["greedy"])]) == 0
    got = {k: {r["id"]: r["output_ids"] for r in read_jsonl(p)} for k, p in outs.items()}
    assert got["mixed"]["r0"] == got["sampled"]["r0"] != got["greedy"]["r0"]
    assert got["mixed"]["r1"] == got["greedy"]["r1"] and got["mixed"]["r2"] == got["greedy"]["r2"]


@pytest.mark.heavy  # a minute; the engine's DFlash2 tests (tests/test_dflash2.py) run everyday
def test_a_dflash2_drafter_runs_sampled_and_its_acceptance_rule_is_part_of_resume(tmp_path, capsys):
    """A DFlash2 drafter (tests/dflash2_reference.py's format): sampled rows run with rejection
    sampling by default, the summary says so; a rerun with --acceptance match does not resume them;
    a draft tree is refused in one line."""
    from dflash2_reference import write_dflash2_drafter

    d2 = tmp_path / "d2"
    write_dflash2_drafter(tiny() / "target", d2, base_dir=tiny() / "drafter", seed=3)
    pair = ["--target", str(tiny() / "target"), "--drafter", str(d2), "--input", str(tiny() / "prompts.jsonl"),
            "--max-new-tokens", "16", "--temperature", "1.0"]
    out, summary = tmp_path / "out.jsonl", tmp_path / "s.json"
    assert main(pair + ["--output", str(out), "--summary-json", str(summary)]) == 0
    assert "(a DFlash2 drafter: drafts drawn from its candidate selector, accepted by rejection sampling)" in \
        capsys.readouterr().err
    records = read_jsonl(out)
    assert len(records) == 8 and all(r["fingerprint"]["acceptance"] == "rejection" for r in records)
    assert all(len(r["output_ids"]) == 16 for r in records)
    s = json.loads(summary.read_text())
    assert s["dflash2"] and s["acceptance"] == "rejection"
    # Auto speculation would draw other tokens at other draft lengths: the run was fixed, and said why
    assert "rejection acceptance" in s["speculation"]["fixed"]
    rerun = tmp_path / "rerun.jsonl"
    assert main(pair + ["--output", str(rerun), "--quiet"]) == 0
    assert [r["output_ids"] for r in read_jsonl(rerun)] == [r["output_ids"] for r in records]
    code = main(pair + ["--output", str(out), "--acceptance", "match", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and 'was generated with --acceptance "rejection", this run has "match"' in err, err
    code = main(pair + ["--tree-budget", "4", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "a DFlash2 drafter drafts by its candidate selector" in err and err.count("\n") == 1, err
