"""`python -m bench`: the figures it writes are consistent (no timing is asserted)."""

import importlib.util
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from dflash_jax.drafter import default_target_layer_ids as default_taps
from dflash_jax.shapes import published_configs
from fixtures import TINY

import bench

MAX_NEW = 12
NUM_PROMPTS = 3
FAST_SPLIT = ["--split-rounds", "2", "--split-min-time", "0.002"]
# a random pair small enough to compile fast: 2 target layers, 1 drafter layer
SMALL_RANDOM = ["--random", "--layers", "2", "--drafter-layers", "1", "--hidden", "64", "--heads", "2", "--vocab", "256",
                "--random-block-size", "4"]



@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """One run on the tiny pair's directories: block 4, and the drafter's block 8 verifying 2
    drafts per cycle; 3 prompts through 2 slots (continuous batching: the third row joins when a
    slot frees); transformers at batch 1; no time split (test_time_split has its own run)."""
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    argv = ["--target", str(TINY / "target"), "--drafter", str(TINY / "drafter"), "--num-prompts", str(NUM_PROMPTS),
            "--max-new-tokens", str(MAX_NEW), "--block-sizes", "4", "--draft-tokens", "2", "--batch-sizes", "2",
            "--hf-batch-sizes", "1", "--repeats", "1", "--torch-threads", "1", "--no-split", "--json", str(out)]
    assert bench.main(argv) == 0
    return json.loads(out.read_text())


def test_environment_pair_and_prompts(demo_run):
    env = demo_run["env"]
    assert env["backend"] and env["devices"] and env["jax_version"] and demo_run["mode"] == "suite"
    assert not demo_run["pair"]["demo"] and not demo_run["pair"]["tokenizer"] and not demo_run["pair"]["random"]
    p = demo_run["prompts"]
    assert p["package"] == "numpy" and p["kind"] == "random_token_ids"  # no tokenizer in the tiny pair
    assert len(p["input_ids"]) == NUM_PROMPTS == len(p["snippets"])
    assert [len(x) for x in p["input_ids"]] == p["lengths"]
    assert 511 not in {t for ids in p["input_ids"] for t in ids}  # the tiny drafter's mask token
    s = demo_run["settings"]
    assert s["block_sizes"] == [4] and s["batch_sizes"] == [2] and s["draft_tokens"] == [2]
    assert s["greedy"] and s["temperature"] == 0
    # matplotlib is in the test extra: the PNG must be drawn.
    assert demo_run["plot"] is not None and Path(demo_run["plot"]).is_file()
    assert Path(demo_run["plot"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_dflash_is_lossless_and_every_row_has_max_new_tokens(demo_run):
    (base,) = demo_run["baseline"]
    assert base["batch_size"] == 2 and len(demo_run["dflash"]) == 2
    assert [(r["batch_size"], r["block_size"], r["draft_tokens"]) for r in demo_run["dflash"]] == [(2, 4, 3), (2, 8, 2)]
    assert [bench.config_label(r) for r in demo_run["dflash"]] == ["4", "8:2"]
    assert all(len(o) == MAX_NEW for o in base["outputs"])
    for r in demo_run["dflash"]:
        assert r["outputs"] == base["outputs"]
        assert r["lossless"] and r["rows_matching_baseline"] == NUM_PROMPTS
        assert r["output_tokens"] == NUM_PROMPTS * MAX_NEW
    assert demo_run["summary"]["lossless"] and demo_run["summary"]["batch_invariant"]


def test_acceptance_figures_and_loop_cycles(demo_run):
    for r in demo_run["dflash"] + demo_run["baseline"]:
        rows = r["acceptance_lengths"]
        # Loop cycles are the engine's own (counted in an untimed run that gave the same tokens): at
        # least the longest row's cycles, fewer than all rows' cycles one after another (two rows
        # share the loop), at least the rows' cycles spread over the 2 slots.
        assert r["counted_run_matches"]
        per_row = [len(x) for x in rows]
        assert max(per_row) <= r["loop_cycles"] < sum(per_row)
        assert r["loop_cycles"] >= math.ceil(sum(per_row) / 2)
        assert r["admissions"] >= 2  # the third prompt waited for a slot
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


def test_no_compilation_during_timed_runs_and_memory(demo_run):
    for r in demo_run["baseline"] + demo_run["dflash"]:
        assert r["compiles_timed"]["prefill"] == 0 and r["compiles_timed"]["run_cycles"] == 0
        assert r["compiles_warmup"]["run_cycles"] >= 1  # the warm-up compiled it (fresh engine spec)
        assert r["host_peak_rss_bytes"] > 0
        assert r["device_peak_bytes"] is None or r["device_peak_bytes"] > 0
        assert "time_split" not in r
    assert demo_run["summary"]["compilations_during_timed_runs"] == 0
    assert demo_run["summary"]["host_peak_rss_bytes"] >= max(r["host_peak_rss_bytes"] for r in demo_run["dflash"])


def test_transformers_side_by_side(demo_run):
    hf = demo_run["transformers"]
    if importlib.util.find_spec("torch") is None:
        assert "skipped" in hf
        return
    assert [r["batch_size"] for r in hf["rows"]] == [1]
    (r,) = hf["rows"]
    assert r["tokens_per_second"] > 0 and r["output_tokens"] == NUM_PROMPTS * MAX_NEW
    assert all(len(o) == MAX_NEW for o in r["outputs"])
    # float32 tiny target, no padding at batch 1: transformers' greedy tokens are ours
    assert r["outputs"] == demo_run["baseline"][0]["outputs"]
    assert r["rows_matching_baseline"] == NUM_PROMPTS


@pytest.mark.heavy
def test_time_split(tmp_path):
    """The time split of the engine's pieces on a small random pair: figures consistent with each
    other and with the run's."""
    out = tmp_path / "split.json"
    argv = [*SMALL_RANDOM, "--num-prompts", "2", "--max-new-tokens", "8", "--batch-sizes", "1", "--block-sizes", "4",
            "--draft-tokens", "", "--repeats", "1", "--json", str(out), *FAST_SPLIT]
    assert bench.main(argv) == 0
    res = json.loads(out.read_text())
    assert res["pair"]["random"] and res["transformers"] == {"skipped": "a random pair in memory has no HF directory"}
    (base,), (r,) = res["baseline"], res["dflash"]
    bs = base["time_split"]
    assert bs["ar_step_s"] > 0 and bs["cycle_s"] > 0 and bs["commit_s"] >= 0 and bs["prefill_s"] > 0
    assert set(bs["iterations"]) == {"ar_verify", "ar_commit", "ar_cycle"}
    assert bs["host_overhead_per_cycle_s"] == pytest.approx(
        (base["seconds"] - bs["prefill_s"]) / base["loop_cycles"] - bs["cycle_s"])
    s = r["time_split"]
    assert set(s["iterations"]) == {"draft", "verify", "extend", "commit", "passes", "cycle", "ar_verify",
                                    "ar_commit", "ar_cycle"}
    assert all(n >= 1 for n in s["iterations"].values())
    for key in ("draft_s", "verify_s", "extend_s", "commit_s", "passes_s", "cycle_s", "ar_step_s", "baseline_cycle_s",
                "prefill_s"):
        assert s[key] > 0, key
    assert s["bookkeeping_s"] == pytest.approx(s["cycle_s"] - s["passes_s"])
    assert s["overhead_beyond_passes_fraction"] == pytest.approx(s["bookkeeping_s"] / s["cycle_s"])
    assert s["passes_interference_s"] == pytest.approx(s["passes_s"] - s["draft_s"] - s["verify_s"] - s["extend_s"])
    assert s["overhead_beyond_pieces_fraction"] == pytest.approx(
        (s["cycle_s"] - s["draft_s"] - s["verify_s"] - s["extend_s"]) / s["cycle_s"])
    assert s["pieces_sum_s"] == pytest.approx(s["draft_s"] + s["verify_s"] + s["commit_s"])
    assert s["cost_ratio"] == pytest.approx(s["cycle_s"] / s["ar_step_s"])
    assert s["speedup_check"] == pytest.approx(r["tau"] / s["cost_ratio"])
    assert s["measured_speedup"] == pytest.approx(r["speedup"])
    assert s["generate_s_per_loop_cycle"] == pytest.approx(r["seconds"] / r["loop_cycles"])
    assert s["host_overhead_per_cycle_s"] == pytest.approx(
        (r["seconds"] - s["prefill_s"]) / r["loop_cycles"] - s["cycle_s"])
    assert math.isfinite(s["host_overhead_per_cycle_s"])
    assert r["lossless"]


@pytest.mark.heavy  # a variant of demo_run's table
def test_quick_table_on_a_random_pair_with_temperature(tmp_path, capsys):
    """--quick (the drafter's block only, no split, no transformers) at a temperature: every row
    still gets its tokens, and the rows share per-position keys with the baseline."""
    out = tmp_path / "quick.json"
    argv = [*SMALL_RANDOM, "--quick", "--temperature", "0.8", "--num-prompts", "2", "--max-new-tokens", "6",
            "--batch-sizes", "1", "--repeats", "1", "--json", str(out)]
    assert bench.main(argv) == 0
    res = json.loads(out.read_text())
    assert res["settings"]["block_sizes"] == [4] and res["settings"]["draft_tokens"] == []
    assert res["settings"]["temperature"] == 0.8 and not res["settings"]["greedy"]
    assert res["transformers"] == {"skipped": "--no-transformers"}
    (r,) = res["dflash"]
    assert "time_split" not in r and r["block_size"] == 4
    assert all(len(o) == 6 for o in r["outputs"])
    assert r["rows_matching_baseline"] == sum(a == b for a, b in zip(r["outputs"], res["baseline"][0]["outputs"]))
    assert "same tokens as the baseline" in capsys.readouterr().out


@pytest.mark.heavy  # the everyday suite is at its budget
def test_tree_budgets_add_a_row_each(tmp_path, capsys):
    """--tree-budgets: beside the chain, one row per budget at the drafter's block, recording its
    budget, the tokens it verifies and its tau, checked against the baseline's tokens like the chain's."""
    out = tmp_path / "tree.json"
    argv = [*SMALL_RANDOM, "--quick", "--tree-budgets", "3,6", "--num-prompts", "2", "--max-new-tokens", "6",
            "--batch-sizes", "1", "--repeats", "1", "--json", str(out)]
    assert bench.main(argv) == 0
    res = json.loads(out.read_text())
    assert res["settings"]["tree_budgets"] == [3, 6]
    rows = res["dflash"]
    assert [(r["block_size"], r["tree_budget"], r["verify_len"]) for r in rows] == [(4, 0, 4), (4, 3, 4), (4, 6, 7)]
    for r in rows:
        assert 1 <= r["tau"] <= 4 and r["cycles"] > 0 and r["lossless"]
        assert list(r["acceptance_histogram"]) == ["1", "2", "3", "4"]  # a tree accepts at most a block
    text = capsys.readouterr().out
    assert " 4t3 " in text and " 4t6 " in text and "draft trees against the chain" in text


@pytest.mark.heavy  # the everyday suite is at its budget
def test_pieces_are_the_engines_own():
    """One iteration of each timed piece equals the engine's function called directly: draft, the
    verify, extend_context, accept + commit, the passes (draft, verify, extend) and the cycle;
    the pieces that write a cache rewind its lengths."""
    from dflash_jax.checkpoint import load_drafter, load_target
    from dflash_jax.drafter import extend_context
    from dflash_jax.engine import BatchEngine, accept, commit, cycle, draft, verify

    tcfg, tparams = load_target(TINY / "target")
    dcfg, dparams = load_drafter(TINY / "drafter")
    gen = BatchEngine(tcfg, tparams, dcfg, dparams, block_size=4, batch_size=2, max_new_tokens=8, max_prompt_len=16, speculation="fixed")
    state = gen.admit(gen.new_state(), [0, 1], [[5, 6, 7, 8], [9, 10, 11]], [0, 1], [8, 8])
    spec, stop = gen.spec, gen.stop_ids
    copy = lambda t: jax.tree.map(lambda x: jnp.array(x, copy=True), t)
    p = bench.pieces()

    drafts = draft(tparams, dparams, spec, state.anchor, state.context_cache)
    assert (p["draft"](tparams, dparams, spec, copy(state.anchor), state.context_cache, 1)
            == (drafts.sum(axis=1) % tcfg.vocab_size)).all()

    block = jnp.concatenate([state.anchor[:, None], drafts], axis=1)
    target_tokens, out = verify(tparams, spec, state, block)
    s1, y = p["verify"](tparams, spec, copy(state), copy(block), 1)
    assert (y == target_tokens).all()
    assert (s1.target_cache.lengths == state.target_cache.lengths).all()  # rewound
    assert jnp.allclose(s1.target_cache.k, out.cache.k, atol=1e-5)  # the verify wrote its K/V

    ones = jnp.ones((2,), jnp.int32)
    ctx = extend_context(dparams, dcfg, out.tap_features, state.context_cache, ones)
    ctx1 = p["extend"](dparams, spec, copy(state.context_cache), out.tap_features, 1)
    assert (ctx1.lengths == state.context_cache.lengths).all() and jnp.allclose(ctx1.k, ctx.k, atol=1e-5)

    verified_state = state.replace(target_cache=out.cache.replace(lengths=state.target_cache.lengths))
    committed = commit(dparams, spec, state, target_tokens, accept(drafts, target_tokens), out, stop)
    c1 = p["commit"](dparams, spec, copy(verified_state), drafts, target_tokens, out.tap_features, stop, 1)
    assert (c1.output == committed.output).all() and (c1.anchor == committed.anchor).all()
    assert (c1.acceptance == committed.acceptance).all()
    assert jnp.allclose(c1.context_cache.k, committed.context_cache.k, atol=1e-5)
    assert (c1.num_generated == state.num_generated).all()  # rewound

    pa = p["passes"](tparams, dparams, spec, copy(state), 1)
    assert (pa.anchor == target_tokens[:, -1]).all()
    assert jnp.allclose(pa.context_cache.k, ctx.k, atol=1e-5)
    assert (pa.target_cache.lengths == state.target_cache.lengths).all()

    whole = cycle(tparams, dparams, spec, state, stop)
    cy = p["cycle"](tparams, dparams, spec, copy(state), stop, 1)
    assert (cy.output == whole.output).all() and (cy.anchor == whole.anchor).all()
    assert (cy.acceptance == whole.acceptance).all()
    assert (cy.target_cache.lengths == state.target_cache.lengths).all()
    assert (cy.num_cycles == state.num_cycles).all() and (cy.done == state.done).all()


def test_synthetic_state_comes_from_init_state():
    from dflash_jax.engine import EngineSpec, Sampling

    target, drafter = published_configs(0.05, "float32")
    spec = EngineSpec(target=target, drafter=drafter, block_size=16, sampling=Sampling(), max_new_tokens=8,
                      cache_len=64)
    s = jax.eval_shape(lambda: bench.synthetic_state(spec, 3, 40))  # abstract: nothing allocated
    assert s.target_cache.k.shape[:3] == (target.num_hidden_layers, 3, 64)
    assert s.max_new_tokens.shape == (3,) and s.context_cache.k.shape[1] == 3
    c = bench.synthetic_state(spec, 3, 40)
    assert (c.target_cache.lengths == 40).all() and (c.context_cache.lengths == 40).all()
    assert not c.done.any() and (c.max_new_tokens == 8).all() and (c.num_generated == 1).all()


@pytest.mark.heavy
def test_published_shapes_at_tiny_scale(tmp_path, capsys):
    out = tmp_path / "pub.json"
    assert bench.main(["--published-shapes", "--scale", "0.05", "--context", "32", "--json", str(out),
                       *FAST_SPLIT]) == 0
    p = json.loads(out.read_text())["published_shapes"]
    assert p["target"]["head_dim"] == 128 and p["block_size"] == 16 and p["dtype"] == "bfloat16"
    assert p["batch_size"] == 1 and p["scale"] == 0.05
    assert p["target"]["hidden_size"] == 128 * p["target"]["num_attention_heads"]
    assert p["target"]["num_attention_heads"] % p["target"]["num_key_value_heads"] == 0
    for key in ("ar_step_s", "verify_s", "draft_s", "extend_s", "commit_s", "passes_s", "cycle_s"):
        assert p[key] > 0, key
    assert p["bookkeeping_s"] == pytest.approx(p["cycle_s"] - p["passes_s"])
    assert p["cost_ratio"] == pytest.approx(p["cycle_s"] / p["ar_step_s"])
    assert p["projected_speedup"] == pytest.approx(6.49 / p["cost_ratio"])
    assert "projected speedup" in capsys.readouterr().out


def test_published_configs_at_full_scale():
    target, drafter = published_configs(1.0)
    assert (target.hidden_size, target.num_hidden_layers, target.num_attention_heads, target.num_key_value_heads,
            target.head_dim, target.intermediate_size, target.vocab_size) == (4096, 36, 32, 8, 128, 12288, 151936)
    assert drafter.model.num_hidden_layers == 5 and drafter.block_size == 16
    assert drafter.target_layer_ids == (1, 9, 17, 25, 33) and drafter.mask_token_id == 151669


def test_published_hybrid_shape_at_full_scale_and_scaled():
    """Qwen3.5-27B: 64 layers, every fourth full attention (24/4 heads x 256, a quarter of each
    rotating), 48 gated delta-net layers (16 q/k heads, 48 value heads, x 128); its drafter is
    dense with whole-head RoPE. Scaled, the layer pattern stays whole."""
    target, drafter = published_configs(1.0, shape="qwen3.5-27b")
    assert (target.hidden_size, target.num_hidden_layers, target.num_attention_heads, target.num_key_value_heads,
            target.head_dim, target.intermediate_size, target.vocab_size) == (5120, 64, 24, 4, 256, 17408, 248320)
    assert target.num_linear_layers == 48 and target.linear_layers[:4] == (True, True, True, False)
    lin = target.linear_attention
    assert (lin.k_heads, lin.v_heads, lin.k_dim, lin.v_dim, lin.conv_kernel) == (16, 48, 128, 128, 4)
    assert target.rope.rotary_dim(target.head_dim) == 64 and target.rope.theta == 1e7
    m = drafter.model
    assert (m.num_hidden_layers, m.num_linear_layers, m.rope.partial_rotary_factor) == (5, 0, 1.0)
    assert drafter.block_size == 16 and drafter.target_layer_ids == default_taps(64, 5)
    small, _ = published_configs(0.25, shape="qwen3.5-27b")
    assert small.num_hidden_layers == 16 and small.linear_layers == (True, True, True, False) * 4
    assert small.linear_attention.v_heads == 3 * small.linear_attention.k_heads
    with pytest.raises(ValueError, match="unknown published shape 'llama-70b'"):
        published_configs(1.0, shape="llama-70b")


def test_published_dflash2_shape_is_the_hybrid_target_with_its_dflash2_drafter():
    """qwen3.8-27b: the qwen3.5-27b target (Qwen3.8-27B's stand-in) with Qwen3.8-27B-DFlash2's drafter:
    5 dense layers, block 8, taps [5, 19, 33, 47, 61], its DFlash2 keys; scaled, the taps move in
    proportion, never onto the last layer, and the drafter stays DFlash2."""
    from dflash_jax.shapes import SHAPES, scaled_taps

    assert "qwen3.8-27b" in SHAPES
    target, drafter = published_configs(1.0, shape="qwen3.8-27b")
    assert target == published_configs(1.0, shape="qwen3.5-27b")[0]
    assert drafter.block_size == 8 and drafter.target_layer_ids == (5, 19, 33, 47, 61)
    assert drafter.model.num_hidden_layers == 5 and drafter.model.hidden_size == 5120
    d2 = drafter.dflash2
    assert (d2.conv_kernel_size, d2.conv_group_size, d2.selector_rank, d2.selector_top_k) == (2, 16, 256, 16)
    assert published_configs(1.0, shape="qwen3.5-27b")[1].dflash2 is None
    small_t, small = published_configs(0.25, shape="qwen3.8-27b")
    assert small_t.num_hidden_layers == 16 and small.target_layer_ids == (1, 5, 8, 12, 14)
    assert small.block_size == 8 and small.dflash2 == d2 and small.model.hidden_size % d2.conv_group_size == 0
    assert scaled_taps((5, 19, 33, 47, 61), 64, 4) == (0, 1, 2)


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


def test_bad_flags_are_refused():
    argv = ["--target", str(TINY / "target"), "--drafter", str(TINY / "drafter"), "--draft-tokens", "3,8"]
    with pytest.raises(SystemExit, match=r"--draft-tokens 8 is outside 1\.\.7 \(the drafter's block size is 8\)"):
        bench.main(argv)
    with pytest.raises(SystemExit, match="separate modes"):
        bench.main(["--cost", "--mixed-workload"])
    with pytest.raises(SystemExit, match="--target and --drafter go together"):
        bench.main(["--target", str(TINY / "target"), "--no-split"])
    # a cache too short for the prompts is refused before anything compiles (it was a traceback from the scheduler)
    with pytest.raises(SystemExit, match=r"--cache-prompt-lens 8,64: the longest prompt has \d+ tokens, more than a "
                                         r"max_prompt_len of 8 holds; give both at least \d+"):
        bench.main(["--cache-scaling", "--target", str(TINY / "target"), "--drafter", str(TINY / "drafter"),
                    "--cache-prompt-lens", "8,64", "--repeats", "1"])


def test_an_unknown_flag_value_is_one_line_and_modes_write_their_own_files(capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--cost", "--shape", "nope"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "invalid choice: 'nope'" in err and "usage" not in err
    from bench.cli import default_json

    files = {default_json(bench.build_parser().parse_args(argv + ["--scale", "0.25"]), mode) for argv, mode in (
        (["--cost"], "cost"), (["--cost", "--shape", "gemma4-31b"], "cost"), (["--random", "--quick"], "suite"),
        ([], "suite"), (["--moe-cost"], "moe_cost"), (["--published-shapes"], "published_shapes"))}
    assert len(files) == 6 and Path("runs/bench/cost-qwen3-8b-x0.25.json") in files


def test_acceptance_figures_by_hand():
    f = bench.acceptance_figures([[1, 3], [4, 2, 1]], 4)
    assert f["cycles"] == 5 and f["tau"] == pytest.approx(11 / 5)
    assert f["acceptance_histogram"] == {"1": 2, "2": 1, "3": 1, "4": 1}
    assert f["per_slot_acceptance"] == pytest.approx([3 / 5, 2 / 5, 1 / 5])


def test_the_bundled_pair_gets_text_prompts(tmp_path):
    """The default pair has a tokenizer: the held-out snippets are tokenised as raw text."""
    from transformers import AutoTokenizer

    from infer.cli import DEMO_DIR

    out = tmp_path / "bench.json"
    assert bench.main(["--num-prompts", "2", "--max-new-tokens", "6", "--block-sizes", "4", "--batch-sizes", "1",
                       "--draft-tokens", "", "--repeats", "1", "--max-prompt-tokens", "40", "--no-split",
                       "--no-transformers", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    p = res["prompts"]
    assert res["pair"]["demo"] and res["pair"]["tokenizer"] and p["kind"] == "text"
    tok = AutoTokenizer.from_pretrained(DEMO_DIR / "target")
    assert p["input_ids"] == [tok(s["text"])["input_ids"][:40] for s in p["snippets"]]
    assert res["dflash"][0]["lossless"] and "time_split" not in res["dflash"][0]
    assert res["transformers"] == {"skipped": "--no-transformers"}


@pytest.mark.heavy
def test_page_pool_mode(tmp_path, capsys):
    """--page-pool on the tiny pair: per-slot caches and a pool of the same K/V bytes decode the
    same tokens; the concurrency figures are the row cycles' (while prompts wait: the busy rows of
    each run call that stopped for a free slot), and the pool runs more rows at once."""
    out = tmp_path / "pool.json"
    argv = ["--page-pool", "--target", str(TINY / "target"), "--drafter", str(TINY / "drafter"),
            "--mixed-prompts", "12", "--mixed-range", "2,24", "--batch-size", "2", "--pool-slots", "8",
            "--page-size", "16", "--max-prompt-tokens", "32", "--repeats", "1", "--json", str(out)]
    assert bench.main(argv) == 0
    m = json.loads(out.read_text())["page_pool"]
    assert m["same_outputs"] and m["kv_bytes"]["pool"] == m["kv_bytes"]["per_slot"] > 0
    assert m["per_slot_batch"] == 2 and m["pool_slots"] == 8 and m["page_size"] == 16
    assert all(2 <= x <= 24 for x in m["limits"]) and all(1 <= n <= 32 for n in m["prompts"]["lengths"])
    per_slot, pool = m["engines"]["per_slot"], m["engines"]["pool"]
    assert per_slot["row_cycles"] == pool["row_cycles"]  # the same rows, cycle for cycle
    for f in (per_slot, pool):
        assert f["concurrent_rows"] == pytest.approx(f["row_cycles"] / f["loop_cycles"])
    assert per_slot["concurrent_rows_while_waiting"] <= 2
    assert m["concurrency_gain"] == pytest.approx(pool["concurrent_rows_while_waiting"]
                                                  / per_slot["concurrent_rows_while_waiting"]) and m["concurrency_gain"] > 1
    assert "the concurrent rows while prompts wait (goal >= 2x)" in capsys.readouterr().out


@pytest.mark.heavy
def test_mixed_workload_mode(tmp_path, capsys):
    out = tmp_path / "mixed.json"
    argv = ["--mixed-workload", "--target", str(TINY / "target"), "--drafter", str(TINY / "drafter"),
            "--mixed-prompts", "5", "--mixed-range", "2,10", "--batch-size", "2", "--repeats", "1", "--json", str(out)]
    assert bench.main(argv) == 0
    m = json.loads(out.read_text())["mixed_workload"]
    limits = m["limits"]
    assert len(limits) == 5 and all(2 <= x <= 10 for x in limits) and m["max_new_tokens_range"] == [2, 10]
    assert m["uniform_limit"] == round(sum(limits) / 5)
    assert [r["method"] for r in m["rows"]] == ["plain", "dflash"]
    for r in m["rows"]:
        assert r["mixed"]["output_tokens"] == sum(limits)  # no stop tokens: every row its own limit
        assert r["uniform"]["output_tokens"] == 5 * m["uniform_limit"]
        assert r["ratio"] == pytest.approx(r["mixed"]["tokens_per_second"] / r["uniform"]["tokens_per_second"])
        assert r["tokens_per_loop_cycle_ratio"] == pytest.approx(
            r["mixed"]["tokens_per_loop_cycle"] / r["uniform"]["tokens_per_loop_cycle"])
        for k in ("mixed", "uniform"):
            f = r[k]
            assert 0 < f["slot_occupancy"] <= 1
            assert f["slot_occupancy"] == pytest.approx(f["row_cycles"] / (f["loop_cycles"] * 2))
            assert f["tokens_per_loop_cycle"] == pytest.approx(f["output_tokens"] / f["loop_cycles"])
            assert f["admissions"] >= 3  # 5 prompts through 2 slots
    assert m["compiles_timed"]["prefill"] == 0 and m["compiles_timed"]["run_cycles"] == 0
    assert "mixed / uniform" in capsys.readouterr().out


@pytest.mark.heavy
def test_cache_scaling_mode(tmp_path):
    out = tmp_path / "cache.json"
    argv = ["--cache-scaling", "--target", str(TINY / "target"), "--drafter", str(TINY / "drafter"),
            "--cache-prompt-lens", "64,1024", "--num-prompts", "2", "--max-new-tokens", "6", "--batch-size", "1",
            "--repeats", "1", "--json", str(out)]
    assert bench.main(argv) == 0
    c = json.loads(out.read_text())["cache_scaling"]
    assert c["max_position_embeddings"] >= 16384
    assert [r["method"] for r in c["rows"]] == ["plain", "dflash"]
    for r in c["rows"]:
        assert r["small"]["max_prompt_len"] == 64 and r["large"]["max_prompt_len"] == 1024
        assert r["large"]["cache_len"] > r["small"]["cache_len"]
        assert r["slowdown"] == pytest.approx(r["small"]["tokens_per_second"] / r["large"]["tokens_per_second"])
        assert r["same_outputs"]  # the allocated cache does not change the tokens
        assert r["small"]["output_tokens"] == r["large"]["output_tokens"] == 2 * 6
        assert r["small"]["loop_cycles"] == r["large"]["loop_cycles"]


@pytest.mark.heavy
def test_device_check_runs_end_to_end_on_a_cpu(tmp_path):
    """bench/device_check.sh --tiny: the GPU check's four parts run through on this CPU with
    tiny shapes (attention path against the walk, published-shape timings, their roofline, cache
    scaling), so the script is ready the day a GPU is lent."""
    import os
    import subprocess

    repo = Path(__file__).resolve().parent.parent
    p = subprocess.run(["bash", str(repo / "bench" / "device_check.sh"), "--tiny"], capture_output=True,
                       text=True, timeout=1800, env={**os.environ, "OUT": str(tmp_path)}, cwd=repo)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "exactness: worst" in p.stdout and "(ok," in p.stdout
    assert "ratio" in p.stdout and "cycle / step" in p.stdout
    published = json.loads((tmp_path / "published.json").read_text())["published_shapes"]
    assert published["ar_step_s"] > 0 and published["cycle_s"] > 0
    assert json.loads((tmp_path / "cache-scaling.json").read_text())["cache_scaling"]


def test_help_puts_each_mode_in_its_own_group_and_is_short(monkeypatch):
    """--help: general options first, then a group per mode (its one-line description, then its
    flags); every flag still listed once. It was 269 lines at 80 columns, with the mode flags among
    the general options and the package docstring as epilog; now about half of that, at most 142
    lines (the floor is about 115: 70 flags a line each, 13 groups of title + description + blank
    line)."""
    import re

    monkeypatch.setenv("COLUMNS", "80")
    parser = bench.build_parser()
    text = parser.format_help()
    lines = text.splitlines()
    assert len(lines) <= 142 and max(map(len, lines)) <= 80
    sections, title = {}, None
    for line in lines:
        if line and not line.startswith(" ") and line.endswith(":"):
            title = line[:-1]
            sections[title] = []
        elif title is not None:
            sections[title].append(line)
    assert list(sections)[0] == "general options"

    def home(flag):
        entry = re.compile(rf"^  (-[\w-]+, )*{re.escape(flag)}(?=[ ,]|$)")  # -h, --help; --x, --no-x
        return [t for t, body in sections.items() if any(entry.match(line) for line in body)]

    for action in parser._actions:
        for flag in action.option_strings:
            if flag.startswith("--"):
                assert len(home(flag)) == 1, (flag, home(flag))
    for flag in ("--target", "--drafter", "--dtype", "--num-prompts", "--batch-size", "--max-new-tokens", "--repeats",
                 "--json"):
        assert home(flag) == ["general options"], flag
    modes = {"--cost": "--cost", "--no-pieces": "--cost", "--aot": "--aot", "--mesh": "--aot",
             "--moe-cost": "--moe-cost", "--published-shapes": "--published-shapes",
             "--cache-scaling": "--cache-scaling", "--mixed-workload": "--mixed-workload",
             "--page-pool": "--page-pool", "--pool-slots": "--page-pool", "--vllm": "--vllm",
             "--vllm-fix-knorm": "--vllm", "--serve": "--serve", "--serve-concurrency": "--serve",
             "--quick": "the suite (default mode)", "--random": "random pair", "--hidden": "random pair"}
    for flag, group in modes.items():
        assert home(flag) == [group], flag
    general = {line.split()[0].rstrip(",") for line in sections["general options"] if line.startswith("  -")}
    assert not general & set(modes) and {"--target", "--json"} <= general  # no mode flag among the general options
    for group in set(modes.values()):  # a one-line description, then the flags
        body = sections[group]
        assert body[0].startswith("  ") and not body[0].startswith("  -") and body[1].startswith("  -"), group
    # the --cost flag's help comes after its group's title and description
    assert text.index("\n--cost:\n") < text.index("abstract weights; rooflines") < text.index("\n--aot:\n")


def test_the_prompts_label_says_what_the_prompts_are():
    """Without a tokenizer (--random, the tiny pair) the prompts are random token ids, not the
    package's snippets: the line says so; with one, the snippets."""
    from bench.prompts import describe_prompts

    snippets = [dict(file="numpy/x.py", line=3, text="def f(x):\n    return x\n"),
                dict(file="numpy/y.py", line=9, text="class A:\n    pass\n")]
    ids = [[5] * 12, [7] * 20]
    random_label = describe_prompts(ids, snippets, "random_token_ids", "numpy", 6)
    first, second = random_label.splitlines()
    assert first.startswith("prompts: 2 rows of seeded random token ids (NO TOKENIZER: not text;")
    assert "held-out snippets from numpy" not in random_label and "12..20 tokens (mean 16.0)" in first
    assert second == "  first: [5, 5, 5, 5, 5, 5, 5, 5, ... 12 ids]"
    text_label = describe_prompts(ids, snippets, "text", "numpy", 6)
    first, second = text_label.splitlines()
    assert first.startswith("prompts: 2 held-out snippets from numpy ") and "tokenised as raw text" in first
    assert "random" not in text_label and second == "  first: numpy/x.py:3: 'def f(x):'"


def test_the_shipped_targets_take_their_checkpoints_formats_and_the_ideal_counts_touched_experts():
    """`bench/shipped_tpu.py`: each target cut as compiled keeps its weights in the format its
    checkpoint ships (FP8 blocks, INT4 groups, MXFP4), and the ideal counts a routed expert stack at
    the share of its experts the tokens touch (the rest of the weights whole)."""
    import jax

    from bench import shipped_tpu
    from dflash_jax.model import abstract_params
    from dflash_jax.model.weights import formats_in

    want = {"deepseek-v3": "fp8_e4m3_128x128", "kimi-k2.5": "int4-g32-bfloat16", "gpt-oss-120b": "mxfp4"}
    for shape, fmt in want.items():
        target, drafter = shipped_tpu.configs(shape, shipped_tpu.CUTS[shape][0])
        assert fmt in formats_in(target.weight_format), (shape, formats_in(target.weight_format))
        assert drafter.model.hidden_size == target.hidden_size and max(drafter.target_layer_ids) < target.num_hidden_layers
    target, _ = shipped_tpu.configs("deepseek-v3", 4)
    params = abstract_params(target)
    routed = sum(x.size * x.dtype.itemsize for path, x in jax.tree_util.tree_leaves_with_path(params)
                 if "experts" in [getattr(k, "key", "") for k in path])
    share = shipped_tpu.expert_fraction(target, 8)
    assert share == pytest.approx(1 - (1 - 8 / 256) ** 8)
    whole = shipped_tpu.stored_bytes(params, target)
    assert shipped_tpu.stored_bytes(params, target, 8) == pytest.approx(whole - routed * (1 - share), rel=1e-9)
    assert shipped_tpu.whole({"x": 10.0}, {"x": 13.0}, 4, 5, 61, lambda f: f["x"]) == 10.0 + 57 * 3.0
