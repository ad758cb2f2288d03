"""The bundled demo pair: an HF Qwen3 that matches our decoder, a drafter that fits it and
speeds it up, and `python -m infer` with no arguments (the README's first command)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash_jax import forward, init_cache, load_drafter, load_target
from dflash_jax.drafter import check_pair
from infer.cli import DEMO_DIR, main
from train import demo_prompts

# An untrained drafter gives 1.0 on the demo prompts.
DEMO_MIN_TAU = 3.5  # measured 4.39 with the bundled pair
MAX_BUNDLE_MB = 40


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_bundle_is_small_and_complete():
    files = [f for f in DEMO_DIR.rglob("*") if f.is_file()]
    names = {str(f.relative_to(DEMO_DIR)) for f in files}
    assert {"target/config.json", "target/model.safetensors", "target/tokenizer.json", "drafter/config.json",
            "drafter/model.safetensors", "prompts.jsonl"} <= names
    assert sum(f.stat().st_size for f in files) <= MAX_BUNDLE_MB * 2**20


def test_target_is_an_hf_qwen3_that_our_decoder_matches():
    tok = AutoTokenizer.from_pretrained(DEMO_DIR / "target")
    hf = AutoModelForCausalLM.from_pretrained(DEMO_DIR / "target", dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen3ForCausalLM"
    ids = tok("def fibonacci(n):\n    if n < 2:\n        return n\n")["input_ids"]
    assert tok.decode(ids) == "def fibonacci(n):\n    if n < 2:\n        return n\n"  # byte-level: lossless
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    cfg, params = load_target(DEMO_DIR / "target", progress=False)
    out = forward(params, cfg, jnp.asarray([ids]), init_cache(cfg, 1, 64))
    np.testing.assert_allclose(np.asarray(out.logits[0]), ref, atol=1e-4, rtol=1e-4)


def test_tokenizer_chat_template_and_drafter_fit_the_target():
    tok = AutoTokenizer.from_pretrained(DEMO_DIR / "target")
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    tcfg, _ = load_target(DEMO_DIR / "target", progress=False)
    dcfg, _ = load_drafter(DEMO_DIR / "drafter", progress=False)
    check_pair(tcfg, dcfg)
    assert dcfg.block_size == 16 and dcfg.mask_token_id == tok.mask_token_id
    assert tok.eos_token_id in json.loads((DEMO_DIR / "target" / "generation_config.json").read_text())["eos_token_id"]


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """`python -m infer` with no arguments but its output files, once for the module: the demo runs
    `--speculation fixed` by default, every cycle verifying the whole block, so tau is the trained
    drafter's (auto speculation, the default elsewhere, runs plain decoding where drafting does not
    pay, as on a CPU)."""
    d = tmp_path_factory.mktemp("demo")
    out, summary = d / "out.jsonl", d / "summary.json"
    assert main(["--output", str(out), "--summary-json", str(summary)]) == 0
    return d, read_jsonl(out), json.loads(summary.read_text())


def test_the_demo_runs_fixed_speculation_unless_told_otherwise():
    from dflash_jax.generation import GenerationJob

    assert GenerationJob().speculation_mode == "fixed" and GenerationJob().resolved().options.speculation == "fixed"
    assert GenerationJob().engine.speculation == "fixed"
    assert GenerationJob.of(speculation="auto").resolved().options.speculation == "auto"  # asked for: auto runs
    assert GenerationJob(input=DEMO_DIR / "prompts.jsonl").speculation_mode == "auto"  # your prompts: auto
    assert GenerationJob.of(block_size=1).speculation_mode == "auto"  # plain decoding: nothing to fix


def test_demo_runs_the_trained_pair_on_its_prompts(demo_run):
    _, records, s = demo_run
    prompts = read_jsonl(DEMO_DIR / "prompts.jsonl")
    assert sorted(r["id"] for r in records) == sorted(p["id"] for p in prompts)
    assert any("messages" in p for p in prompts) and any("prompt" in p for p in prompts)
    for r in records:
        assert r["text"] and r["num_output_tokens"] == len(r["output_ids"]) <= 128
        assert sum(r["acceptance_lengths"]) >= r["num_output_tokens"]
    # The drafter is trained: blocks of 16 are accepted several tokens deep, not 1.
    assert s["block_size"] == 16 and s["tau"] >= DEMO_MIN_TAU
    # It ran DFlash: every cycle of every row drafted the whole block, none ran plain decoding.
    assert s["speculation"]["mode"] == "fixed" and s["speculation"]["share"] == {"15": 1.0}
    assert s["plain_cycles"] == 0 and all("plain_cycles" not in r for r in records)
    assert s["cycles"] == sum(len(r["acceptance_lengths"]) for r in records)
    assert s["baseline"]["tau"] == 1.0 and s["speedup"] > 0  # the demo compares with plain decoding
    assert s["timed_on"] == jax.default_backend()
    # What auto speculation, the default for other runs, would do here, from the two timings.
    verdict = "run plain decoding" if s["baseline"]["tokens_per_second"] > s["tokens_per_second"] else "draft"
    assert s["auto"].startswith(f"auto speculation (the default for your own runs) would {verdict}")
    assert f"at tau {s['tau']:.3f}" in s["auto"] and f"{s['baseline']['tokens_per_second']:.1f} tokens/s" in s["auto"]
    # Its tau is shown beside the held-out figure, and a CPU's speedup beside why and what the
    # cost report projects where a step is memory-bound.
    assert s["heldout"]["block_size"] == 16 and 1 < s["heldout"]["tau"] < s["tau"]
    if jax.default_backend() == "cpu":
        # the command the note names prints the figure it quotes; the verify is the block's
        assert "memory-bound" in s["note"] and "`python -m bench --cost --scale 1`" in s["note"]
        assert "a 16-token verify" in s["note"]
    assert s["prompts"] == "the demo's prompts"


def test_demo_prompts_stop_where_the_tokenizer_would_split():
    """A prompt ending in a bare newline cuts the merged newline + indentation token the target
    was trained on (it then answers with a new top-level block): each code prompt ends with the
    newline and the indentation less one space, which the next word's token carries."""
    tok = AutoTokenizer.from_pretrained(str(DEMO_DIR / "target"))
    for p in read_jsonl(DEMO_DIR / "prompts.jsonl"):
        if "prompt" not in p:
            continue
        text = p["prompt"]
        ids = tok(text)["input_ids"]
        last = tok.decode(ids[-1:])
        assert last.startswith("\n") and last.strip(" ") == "\n" and len(last) > 1, (p["id"], last)
        body = tok(text + " pass\n")["input_ids"]  # the continuation's first word keeps the split
        assert body[:len(ids)] == ids, p["id"]


def test_demo_is_lossless_against_plain_decoding(demo_run):
    d, records, _ = demo_run
    base = d / "base.jsonl"
    assert main(["--output", str(base), "--block-size", "1", "--quiet"]) == 0
    b = {r["id"]: r for r in read_jsonl(base)}
    for r in records:
        assert r["output_ids"] == b[r["id"]]["output_ids"] and r["text"] == b[r["id"]]["text"]
        assert set(b[r["id"]]["acceptance_lengths"]) == {1}


def test_demo_prompts_start_at_defs_or_at_any_code_line(tmp_path):
    src = tmp_path / "mod.py"
    src.write_text("import os\n\n# a comment\ndef f(x):\n    y = x + 1\n    return y\n\n"
                   "class C:\n    def g(self):\n        return os.sep\n")
    defs = demo_prompts.snippets([src], num=50, seed=0)
    lines = demo_prompts.snippets([src], num=50, seed=0, starts="lines")
    assert {t.splitlines()[0].split("(")[0].split(":")[0].strip() for t in defs} == {"def f", "class C", "def g"}
    firsts = {t.splitlines()[0] for t in lines}
    assert len(lines) == len(set(lines)) > len(defs)
    assert "import os" in firsts and "    y = x + 1" in firsts
    assert not any(f.strip() == "" or f.lstrip().startswith("#") for f in firsts)
    assert lines == demo_prompts.snippets([src], num=50, seed=0, starts="lines")  # seeded


def test_demo_prompts_cli_keeps_ids_unique_across_modes(tmp_path, monkeypatch):
    src = tmp_path / "mod.py"
    src.write_text("def f(x):\n    return x\n\ndef g(y):\n    return y\n")
    monkeypatch.setattr(demo_prompts, "source_files", lambda source: [src])
    ids = []
    for mode in ("defs", "lines"):
        out = tmp_path / f"{mode}.jsonl"
        assert demo_prompts.main(["--out", str(out), "--num", "10", "--starts", mode]) == 0
        ids += [r["id"] for r in read_jsonl(out)]
    assert len(ids) == len(set(ids)) and "stdlib-0" in ids and "stdlib-lines-0" in ids


def test_demo_prompts_exclude_earlier_sets_and_name_ids(tmp_path, monkeypatch):
    src = tmp_path / "mod.py"
    src.write_text("".join(f"def f{i}(x):\n    y = x * {i}\n    z = y + {i}\n    return z\n\n" for i in range(12)))
    monkeypatch.setattr(demo_prompts, "source_files", lambda source: [src])
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    everything = demo_prompts.snippets([src], num=1000, seed=5, starts="lines")
    assert demo_prompts.main(["--out", str(first), "--num", "6", "--starts", "lines", "--seed", "5"]) == 0
    assert demo_prompts.main(["--out", str(second), "--num", "6", "--starts", "lines", "--seed", "5",
                              "--exclude", str(first), "--id-prefix", "more"]) == 0
    a, b = read_jsonl(first), read_jsonl(second)
    assert [r["prompt"] for r in a] == everything[:6]
    assert [r["prompt"] for r in b] == everything[6:12]  # the same draw, the excluded ones skipped
    assert [r["id"] for r in b] == [f"more-{i}" for i in range(6)]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x"}\n{oops\n')
    with pytest.raises(SystemExit, match="bad.jsonl line 2 column 2: not valid JSON"):
        demo_prompts.main(["--out", str(second), "--exclude", str(bad)])
