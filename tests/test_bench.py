"""`python -m infer.bench`: the figures it writes are consistent (no timing is asserted)."""

import importlib.util
import json
import math
from pathlib import Path

import jax
import pytest

from infer import bench

MAX_NEW = 12
NUM_PROMPTS = 3
FAST_SPLIT = ["--split-rounds", "2", "--split-min-time", "0.002"]


TINY = Path(__file__).resolve().parents[1] / "dflash_jax" / "demo" / "tiny"


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """One run on the tiny random pair: block 4, and the drafter's block 8 verifying 2 drafts per
    cycle; batches 1 and 2 (3 prompts: a partial batch)."""
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    argv = ["--target", str(TINY / "target"), "--drafter", str(TINY / "drafter"), "--num-prompts", str(NUM_PROMPTS), "--max-new-tokens", str(MAX_NEW), "--block-sizes", "4",
            "--draft-tokens", "2", "--batch-sizes", "1,2", "--repeats", "1", "--torch-threads", "1", "--json", str(out), *FAST_SPLIT]
    assert bench.main(argv) == 0
    return json.loads(out.read_text())


def test_environment_pair_and_prompts(demo_run):
    env = demo_run["env"]
    assert env["backend"] and env["devices"] and env["jax_version"]
    assert not demo_run["pair"]["demo"] and not demo_run["pair"]["tokenizer"]
    p = demo_run["prompts"]
    assert p["package"] == "numpy" and p["kind"] == "random_token_ids"  # no tokenizer in the tiny pair
    assert len(p["input_ids"]) == NUM_PROMPTS == len(p["snippets"])
    assert [len(x) for x in p["input_ids"]] == p["lengths"]
    assert 511 not in {t for ids in p["input_ids"] for t in ids}  # the tiny drafter's mask token
    assert demo_run["settings"]["block_sizes"] == [4] and demo_run["settings"]["batch_sizes"] == [1, 2]
    assert demo_run["settings"]["draft_tokens"] == [2]
    # matplotlib is in the test extra: the PNG must be drawn.
    assert demo_run["plot"] is not None and Path(demo_run["plot"]).is_file()
    assert Path(demo_run["plot"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_dflash_is_lossless_and_every_row_has_max_new_tokens(demo_run):
    base = {r["batch_size"]: r for r in demo_run["baseline"]}
    assert sorted(base) == [1, 2] and len(demo_run["dflash"]) == 4
    assert [(r["batch_size"], r["block_size"], r["draft_tokens"]) for r in demo_run["dflash"]] == [
        (1, 4, 3), (1, 8, 2), (2, 4, 3), (2, 8, 2)]
    assert [bench.config_label(r) for r in demo_run["dflash"][:2]] == ["4", "8:2"]
    assert base[1]["outputs"] == base[2]["outputs"]  # greedy rows do not depend on their batch
    for r in demo_run["dflash"]:
        assert r["outputs"] == base[r["batch_size"]]["outputs"]
        assert r["lossless"] and r["rows_matching_baseline"] == NUM_PROMPTS
        assert all(len(o) == MAX_NEW for o in r["outputs"])
        assert r["output_tokens"] == NUM_PROMPTS * MAX_NEW
    assert demo_run["summary"]["lossless"]


def test_acceptance_figures_are_consistent(demo_run):
    for r in demo_run["dflash"]:
        b = r["draft_tokens"] + 1  # the longest acceptance: the block, or K + 1 drafts verified
        flat = [a for row in r["acceptance_lengths"] for a in row]
        assert all(1 <= a <= b for a in flat)
        assert r["cycles"] == len(flat) > 0
        hist = r["acceptance_histogram"]
        assert list(hist) == [str(k) for k in range(1, b + 1)]
        assert sum(hist.values()) == r["cycles"]
        assert all(hist[str(k)] == flat.count(k) for k in range(1, b + 1))
        assert r["tau"] == pytest.approx(sum(flat) / len(flat))
        slots = r["per_slot_acceptance"]
        assert len(slots) == b - 1
        assert all(0.0 <= s <= 1.0 for s in slots)
        assert all(x >= y for x, y in zip(slots, slots[1:]))
        for k, s in enumerate(slots, 1):
            assert s == pytest.approx(sum(a > k for a in flat) / len(flat))
        # tau = 1 + sum of the per-slot rates (E[a+1] = 1 + sum_k P(a >= k))
        assert r["tau"] == pytest.approx(1 + sum(slots))
        # loop cycles: batch 1 runs every row's cycles; a batch runs its longest row's
        rows = r["acceptance_lengths"]
        if r["batch_size"] == 1:
            assert r["loop_cycles"] == r["cycles"]
        else:
            assert r["loop_cycles"] == sum(max(len(x) for x in rows[i:i + 2]) for i in range(0, len(rows), 2))


def test_no_compilation_during_timed_runs(demo_run):
    for r in demo_run["baseline"] + demo_run["dflash"]:
        assert r["compiles_timed"]["prefill"] == 0 and r["compiles_timed"]["run_cycles"] == 0
        assert r["compiles_warmup"]["run_cycles"] >= 1  # the warm-up compiled it (fresh engine spec)
    assert demo_run["summary"]["compilations_during_timed_runs"] == 0


def test_time_split(demo_run):
    for r in demo_run["dflash"]:
        s = r["time_split"]
        for key in ("draft_s", "verify_s", "cycle_s", "ar_step_s", "baseline_cycle_s", "prefill_s"):
            assert s[key] > 0, key
        assert s["cost_ratio"] > 0
        assert s["cost_ratio"] == pytest.approx(s["cycle_s"] / s["ar_step_s"])
        assert s["speedup_check"] == pytest.approx(r["tau"] / s["cost_ratio"])
        assert s["passes_s"] > 0
        assert s["accept_commit_s"] == pytest.approx(s["cycle_s"] - s["passes_s"])
        assert s["overhead_beyond_passes_fraction"] == pytest.approx(s["accept_commit_s"] / s["cycle_s"])
        assert s["passes_interference_s"] == pytest.approx(s["passes_s"] - s["draft_s"] - s["verify_s"])
        assert s["overhead_beyond_draft_verify_fraction"] == pytest.approx(
            (s["cycle_s"] - s["draft_s"] - s["verify_s"]) / s["cycle_s"])
        assert s["measured_speedup"] == pytest.approx(r["speedup"])
        assert s["host_overhead_per_cycle_s"] == pytest.approx(
            (r["seconds"] - s["prefill_s"]) / r["loop_cycles"] - s["cycle_s"])
        assert math.isfinite(s["host_overhead_per_cycle_s"])


def test_transformers_side_by_side(demo_run):
    hf = demo_run["transformers"]
    if importlib.util.find_spec("torch") is None:
        assert "skipped" in hf
        return
    assert [r["batch_size"] for r in hf["rows"]] == [1, 2]
    for r in hf["rows"]:
        assert r["tokens_per_second"] > 0 and r["output_tokens"] == NUM_PROMPTS * MAX_NEW
        assert all(len(o) == MAX_NEW for o in r["outputs"])
    # float32 tiny target, no padding at batch 1: transformers' greedy tokens are ours
    assert hf["rows"][0]["outputs"] == demo_run["baseline"][0]["outputs"]


def test_published_shapes_at_tiny_scale(tmp_path, capsys):
    out = tmp_path / "pub.json"
    assert bench.main(["--published-shapes", "--scale", "0.05", "--context", "32", "--json", str(out),
                       *FAST_SPLIT]) == 0
    p = json.loads(out.read_text())["published_shapes"]
    assert p["target"]["head_dim"] == 128 and p["block_size"] == 16 and p["dtype"] == "bfloat16"
    assert p["target"]["hidden_size"] == 128 * p["target"]["num_attention_heads"]
    assert p["target"]["num_attention_heads"] % p["target"]["num_key_value_heads"] == 0
    for key in ("ar_step_s", "verify_s", "draft_s", "passes_s", "cycle_s"):
        assert p[key] > 0, key
    assert p["accept_commit_s"] == pytest.approx(p["cycle_s"] - p["passes_s"])
    assert p["cost_ratio"] == pytest.approx(p["cycle_s"] / p["ar_step_s"])
    assert p["projected_speedup"] == pytest.approx(6.49 / p["cost_ratio"])
    assert "projected speedup" in capsys.readouterr().out


def test_published_configs_at_full_scale():
    target, drafter = bench.published_configs(1.0)
    assert (target.hidden_size, target.num_hidden_layers, target.num_attention_heads, target.num_key_value_heads,
            target.head_dim, target.intermediate_size, target.vocab_size) == (4096, 36, 32, 8, 128, 12288, 151936)
    assert drafter.model.num_hidden_layers == 5 and drafter.block_size == 16
    assert drafter.target_layer_ids == (1, 9, 17, 25, 33) and drafter.mask_token_id == 151669


def test_heldout_snippets_are_deterministic_source_excerpts():
    a = bench.heldout_snippets("numpy", num=5, seed=3, lines=4)
    assert a == bench.heldout_snippets("numpy", num=5, seed=3, lines=4)
    assert a != bench.heldout_snippets("numpy", num=5, seed=4, lines=4)
    assert len(a) == 5 and len({s["file"] for s in a}) == 5  # one snippet per file
    root = bench.package_root("numpy").parent
    for s in a:
        path = root / s["file"]
        assert path.suffix == ".py" and s["file"].startswith("numpy/")
        assert not {"tests", "test"} & set(Path(s["file"]).parts)
        first = s["text"].splitlines()[0]
        assert bench.DEF_LINE.match(first)
        src = path.read_text(encoding="utf-8").splitlines()
        assert src[s["line"] - 1].strip() == first.strip()
        assert 1 <= len(s["text"].splitlines()) <= 4
    # another package works too, and its files come from it
    b = bench.heldout_snippets("json", num=2, seed=0)
    assert all(s["file"].startswith("json/") for s in b)


def test_prompt_ids_without_tokenizer_are_seeded_and_avoid_the_mask():
    snippets = [dict(text="x" * 40), dict(text="y" * 400), dict(text="z")]
    ids, kind = bench.prompt_ids(snippets, None, 16, [15], max_tokens=64, seed=1)
    assert kind == "random_token_ids"
    assert [len(x) for x in ids] == [10, 64, 4]
    assert all(0 <= t < 15 for x in ids for t in x)
    assert ids == bench.prompt_ids(snippets, None, 16, [15], max_tokens=64, seed=1)[0]


def test_draft_tokens_outside_the_drafters_block_are_refused(capsys):
    argv = ["--target", str(TINY / "target"), "--drafter", str(TINY / "drafter"), "--draft-tokens", "3,8"]
    with pytest.raises(SystemExit, match=r"--draft-tokens 8 is outside 1\.\.7 \(the drafter's block size is 8\)"):
        bench.main(argv)


def test_acceptance_figures_by_hand():
    f = bench.acceptance_figures([[1, 3], [4, 2, 1]], 4)
    assert f["cycles"] == 5 and f["tau"] == pytest.approx(11 / 5)
    assert f["acceptance_histogram"] == {"1": 2, "2": 1, "3": 1, "4": 1}
    assert f["per_slot_acceptance"] == pytest.approx([3 / 5, 2 / 5, 1 / 5])
    assert bench.loop_cycles([[1, 3], [4, 2, 1], [2]], 2) == 3 + 1


def test_the_bundled_pair_gets_text_prompts(tmp_path):
    """The default pair has a tokenizer: the held-out snippets are tokenised as raw text."""
    from transformers import AutoTokenizer

    from infer.cli import DEMO_DIR

    out = tmp_path / "bench.json"
    assert bench.main(["--num-prompts", "2", "--max-new-tokens", "6", "--block-sizes", "4", "--batch-sizes", "1",
                       "--repeats", "1", "--max-prompt-tokens", "40", "--no-split", "--no-transformers",
                       "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    p = res["prompts"]
    assert res["pair"]["demo"] and res["pair"]["tokenizer"] and p["kind"] == "text"
    tok = AutoTokenizer.from_pretrained(DEMO_DIR / "target")
    assert p["input_ids"] == [tok(s["text"])["input_ids"][:40] for s in p["snippets"]]
    assert res["dflash"][0]["lossless"] and "time_split" not in res["dflash"][0]
    assert res["transformers"] == {"skipped": "--no-transformers"}


def test_passes_piece_runs_the_draft_then_the_verify():
    """The `passes` piece (the two model passes back to back, timed against the cycle) does the
    drafter's work and the verify: one iteration equals extend_context + draft + forward."""
    import jax.numpy as jnp

    from dflash_jax.checkpoint import load_drafter, load_target
    from dflash_jax.drafter import extend_context
    from dflash_jax.model import forward
    from dflash_jax.engine import Generator, draft

    tcfg, tparams = load_target(TINY / "target")
    dcfg, dparams = load_drafter(TINY / "drafter")
    gen = Generator(tcfg, tparams, dcfg, dparams, block_size=4, batch_size=2, max_new_tokens=8, max_prompt_len=16)
    state = gen.prefill([[5, 6, 7, 8], [9, 10, 11]], [0, 1])
    spec = gen.spec
    first = jnp.concatenate([state.anchor[:, None], draft(tparams, dparams, spec, state.anchor,
                                                                state.context_cache)], axis=1)
    taps = forward(tparams, tcfg, first, state.target_cache, taps=spec.taps).tap_features
    ctx = extend_context(dparams, dcfg, taps, state.context_cache, jnp.ones((2,), jnp.int32))
    block = jnp.concatenate([state.anchor[:, None], draft(tparams, dparams, spec, state.anchor, ctx)], axis=1)
    out = forward(tparams, tcfg, block, state.target_cache, taps=spec.taps)
    expect_anchor = jnp.argmax(out.logits, axis=-1)[:, -1]

    passes = bench.pieces()[2]
    copy = lambda t: jax.tree.map(lambda x: jnp.array(x, copy=True), t)
    anchor, ctx_out, cache_out, taps_out = passes(tparams, dparams, spec, copy(state.anchor),
                                                  copy(state.context_cache), copy(state.target_cache), taps, 1)
    assert (anchor == expect_anchor).all()
    assert jnp.allclose(taps_out, out.tap_features, atol=1e-5)
    assert (cache_out.lengths == state.target_cache.lengths).all()  # rewound for the next iteration
    assert jnp.allclose(cache_out.k, out.cache.k, atol=1e-5)  # the verify wrote its K/V
