"""`python -m bench --cost`: the cost report's correction of XLA's loop counting, checked
against XLA itself; figures consistent with what it prints (tiny published shapes, abstract
weights: nothing is allocated or run)."""

import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.shapes import published_configs

import bench

SCALE = 0.05  # 2 target layers, 1 drafter layer, 2/1 heads x 128, vocab 7552


def specs(cache_len, page_size=128, dtype="float32"):
    from dflash_jax.engine import EngineSpec, Sampling

    target, drafter = published_configs(SCALE, dtype)
    common = dict(target=target, sampling=Sampling(), max_new_tokens=16, cache_len=cache_len, page_size=page_size)
    return (EngineSpec(drafter=None, block_size=1, **common),
            EngineSpec(drafter=drafter, block_size=16, **common))


def kv_bytes(config, batch, positions):
    """K and V of `positions` positions of every layer and row."""
    return config.num_hidden_layers * batch * positions * config.num_key_value_heads * config.head_dim * 2 * 4


@pytest.fixture(scope="module")
def cost_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("cost") / "cost.json"
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert bench.main(["--cost", "--scale", str(SCALE), "--context", "256", "--batch-size", "2",
                           "--compare-cache-len", "2048", "--json", str(out)]) == 0
    return json.loads(out.read_text())["cost"], buf.getvalue()


def test_report_figures_add_up(cost_run):
    from dflash_jax.model import abstract_params

    c, printed = cost_run
    assert c["dtype"] == "float32" and c["batch_size"] == 2 and c["context"] == 256 and c["scale"] == SCALE
    assert c["cache_len_asked"] == 256 + 32 and c["cache_len"] == 384  # whole pages of 128
    ar_spec, df_spec = specs(c["cache_len"])
    tparams = abstract_params(ar_spec.target)
    for key, spec in (("ar", ar_spec), ("dflash", df_spec)):
        f = c[key]
        corr, ideal = f["correction"], f["ideal"]
        assert f["verify_len"] == spec.verify_len and f["allocated_cache_len"] == 384
        assert corr["bytes"] == (corr["target_page_bytes"] + corr["drafter_page_bytes"] + corr["target_write_bytes"]
                                 + corr["lookup_bytes"]                                 + corr["drafter_write_bytes"])
        assert f["corrected_bytes"] == f["xla_bytes"] + corr["bytes"]
        assert f["corrected_flops"] == f["xla_flops"] + corr["flops"]
        # the pages walked: ceil((context + verify) / page) in the target, ceil(context / page) in the drafter
        assert corr["target_pages"] == math.ceil((256 + spec.verify_len) / 128) == 3
        assert corr["target_page_bytes"] == kv_bytes(spec.target, 2, 128 * (corr["target_pages"] - 1))
        # ideal: weights once, the used K/V read once
        # ...every lookup counted as its rows, not the table (the AR step looks up once, DFlash twice)
        hidden, vocab = spec.target.hidden_size, spec.target.vocab_size
        rows = 2 * spec.verify_len + (2 * spec.block_size if spec.uses_drafter else 0)
        assert corr["lookups"] == (2 if spec.uses_drafter else 1) and corr["lookup_rows"] == rows
        assert corr["lookup_bytes"] == rows * hidden * 4 - corr["lookups"] * vocab * hidden * 4
        assert ideal["target_weights"] == bench.param_bytes(tparams) - vocab * hidden * 4  # untied: rows only
        assert ideal["embedding_rows"] == rows * hidden * 4
        assert ideal["target_kv"] == kv_bytes(spec.target, 2, 256)
        assert f["ideal_bytes"] == sum(v for k, v in ideal.items() if k != "bytes")
        assert f["corrected_over_ideal"] == pytest.approx(f["corrected_bytes"] / f["ideal_bytes"])
        for name, hw in c["hardware"].items():
            r = f["roofline"][name]
            assert r["seconds"] == pytest.approx(max(f["corrected_flops"] / hw["flops"],
                                                     f["corrected_bytes"] / hw["bandwidth"]))
            assert r["ideal_seconds"] == pytest.approx(max(f["corrected_flops"] / hw["flops"],
                                                           f["ideal_bytes"] / hw["bandwidth"]))
    d = c["dflash"]
    assert d["correction"]["drafter_pages"] == 2 and c["ar"]["correction"]["drafter_pages"] == 0
    assert d["ideal"]["lm_head_again"] == df_spec.target.hidden_size * df_spec.target.vocab_size * 4
    assert d["ideal"]["drafter_kv"] == kv_bytes(df_spec.drafter.model, 2, 256)
    # the printed table carries the same ratios, and the projection is tau x t_AR / t_cycle
    line = next(l for l in printed.splitlines() if l.startswith("corrected / ideal"))
    assert re.findall(r"[\d.]+x", line) == [f"{c['ar']['corrected_over_ideal']:.2f}x",
                                              f"{d['corrected_over_ideal']:.2f}x"]
    for name, p in c["projected"].items():
        t_ar, t_df = c["ar"]["roofline"][name]["seconds"], d["roofline"][name]["seconds"]
        assert p["speedup"] == pytest.approx(6.49 * t_ar / t_df)
        assert f"{name} {p['speedup']:.2f}x" in printed


def test_bytes_do_not_grow_with_the_allocated_cache(cost_run):
    c, printed = cost_run
    cmp = c["compare"]
    assert cmp["cache_len"] == 2048
    for key in ("ar", "dflash"):
        assert cmp[key]["allocated_cache_len"] == 2048
        assert cmp[key]["xla_bytes"] == c[key]["xla_bytes"]
        assert cmp[key]["corrected_bytes"] == c[key]["corrected_bytes"]
        assert cmp[key]["growth_vs_cache_len"] == 1.0
    assert "1.000x the figure at cache 384" in printed


def test_pieces_add_up_to_the_cycle(cost_run):
    c, _ = cost_run
    total = sum(p["corrected_bytes"] for p in c["pieces"].values())
    assert set(c["pieces"]) == {"draft", "verify", "accept_commit"}
    assert total == pytest.approx(c["dflash"]["corrected_bytes"], rel=0.1)


def test_the_correction_is_zero_where_xla_sees_every_page_and_row():
    """Batch 1 and a context inside one page: nothing to correct, corrected == XLA's figure;
    XLA's figure does not move with the context (a loop body is counted once), the correction does."""
    for spec in specs(256):
        one = bench.cycle_cost(spec, 1, 100)
        assert one["correction"]["bytes"] == one["correction"]["lookup_bytes"] and one["correction"]["flops"] == 0
        assert one["corrected_bytes"] == one["xla_bytes"] + one["correction"]["lookup_bytes"]
        assert one["corrected_flops"] == one["xla_flops"]
        three = bench.cycle_cost(spec, 1, 200)  # 3 pages for the verify (2 in the drafter)
        assert three["xla_bytes"] == one["xla_bytes"] and three["xla_flops"] == one["xla_flops"]
        assert three["corrected_bytes"] > one["corrected_bytes"]


def test_the_page_correction_against_xla_counting_every_page():
    """At context 100, a page of 128 holds every position (XLA counts the one-page walk exactly);
    with pages of 64 the walk is 2 pages and XLA counts 1. The correction adds the second page's
    K/V and attention products: the flops match XLA's count of the whole walk, and the bytes stay
    within what XLA counts for it (its unfused CPU walk also moves score intermediates)."""
    for s128, s64 in zip(specs(256, 128), specs(256, 64)):
        whole, paged = bench.cycle_cost(s128, 1, 100), bench.cycle_cost(s64, 1, 100)
        assert whole["correction"]["bytes"] == whole["correction"]["lookup_bytes"]
        assert paged["correction"]["target_pages"] == 2
        assert paged["correction"]["target_page_bytes"] == kv_bytes(s64.target, 1, 64)
        assert paged["corrected_flops"] == pytest.approx(whole["xla_flops"], rel=2e-3)
        assert paged["xla_flops"] < whole["xla_flops"]
        missing = whole["xla_bytes"] - paged["xla_bytes"]  # XLA's own count of the second page
        page_kv = paged["correction"]["target_page_bytes"] + paged["correction"]["drafter_page_bytes"]
        assert 0 < page_kv <= missing


def test_doubling_the_context_adds_exactly_the_extra_kv():
    for spec in specs(1024):
        a, b = bench.cycle_cost(spec, 2, 256), bench.cycle_cost(spec, 2, 512)
        assert a["xla_bytes"] == b["xla_bytes"]
        extra = kv_bytes(spec.target, 2, 256)
        if spec.uses_drafter:
            extra += kv_bytes(spec.drafter.model, 2, 256)
        assert b["corrected_bytes"] - a["corrected_bytes"] == extra
        assert b["ideal_bytes"] - a["ideal_bytes"] == extra


def test_xla_counts_a_row_write_once_per_loop():
    """The basis of the write correction: XLA counts a one-row write as the update read and
    written, and a write of n rows (a loop) as one row's, whatever n."""
    from dflash_jax.kv import write_kv

    row = 16 * 2 * 128 * 4
    buf = jax.ShapeDtypeStruct((2, 4, 256, 2 * 128), jnp.float32)  # a position's heads one row

    def xla_bytes(n):
        new = jax.ShapeDtypeStruct((n, 16, 2, 128), jnp.float32)
        off = jax.ShapeDtypeStruct((n,), jnp.int32)
        compiled = jax.jit(lambda b, x, o: write_kv(b, 1, x, o), donate_argnums=0).lower(buf, new, off).compile()
        return bench.xla_cost(compiled)[1]

    assert xla_bytes(1) == pytest.approx(2 * row, abs=64)
    assert xla_bytes(4) == pytest.approx(xla_bytes(2), abs=64)  # the offsets array grows, nothing else
    assert xla_bytes(4) < 2 * 2 * row


def test_xla_counts_a_lookup_as_its_whole_table():
    """The basis of the lookup correction: XLA's figure for an embedding lookup fused with its
    consumer grows with the table, not with the rows looked up."""
    def xla_bytes(vocab, rows):
        table = jax.ShapeDtypeStruct((vocab, 256), jnp.float32)
        ids = jax.ShapeDtypeStruct((rows,), jnp.int32)
        return bench.xla_cost(jax.jit(lambda t, i: jnp.take(t, i, axis=0) * 2).lower(table, ids).compile())[1]

    assert bench.gather_counts_table("float32")
    assert xla_bytes(8192, 8) - xla_bytes(4096, 8) == pytest.approx(4096 * 256 * 4, rel=0.01)
    assert xla_bytes(4096, 16) - xla_bytes(4096, 8) < 0.01 * 4096 * 256 * 4


# --------------------------------------------------------------------------- MoE


def test_expected_experts_touched_matches_simulated_routing():
    from bench.moe_cost import expected_experts

    rng = np.random.default_rng(0)
    for experts, k, tokens in ((32, 4, 1), (32, 4, 16), (128, 8, 16), (128, 8, 128)):
        touched = [len({e for _ in range(tokens) for e in rng.choice(experts, k, replace=False)}) for _ in range(300)]
        assert abs(np.mean(touched) - expected_experts(experts, k, tokens)) < 0.02 * experts, (experts, k, tokens)
    assert expected_experts(32, 4, 1) == pytest.approx(4.0)


def test_moe_cost_report_adds_up_on_the_published_configs():
    from bench.moe_cost import PUBLISHED_MOE, kv_bytes, moe_report

    r = moe_report("gpt-oss-20b", PUBLISHED_MOE["gpt-oss-20b"], batch=1, context=1024, block=16, tau=6.49)
    # One gpt-oss-20b expert: gate_up 2880 x 5760 and down 2880 x 2880 with their biases, bfloat16.
    assert r["expert_bytes"] == 2 * (2880 * 5760 + 5760 + 2880 * 2880 + 2880)
    assert r["ar"]["experts_touched"] == pytest.approx(4.0)
    from dflash_jax.families import model_config

    config = model_config(PUBLISHED_MOE["gpt-oss-20b"])
    want = (r["always_bytes"] + 24 * 4 * r["expert_bytes"] + r["lm_head_bytes"] + 2880 * 2
            + kv_bytes(config, 1, 1024))
    assert r["ar"]["bytes"] == pytest.approx(want)
    assert config.sliding_windows[0] == 128 and kv_bytes(config, 1, 1024) < 24 * 1024 * 8 * 64 * 2 * 2
    # A 16-token verify touches far more experts than a step, and the cycle costs several steps.
    assert 20 < r["verify"]["experts_touched"] < 32
    h200 = r["hardware"]["H200"]
    assert h200["cost_ratio"] > 3 and h200["projected_speedup"] == pytest.approx(6.49 / h200["cost_ratio"])
    qwen = moe_report("Qwen3-30B-A3B", PUBLISHED_MOE["Qwen3-30B-A3B"], batch=8, context=1024, block=16, tau=6.49)
    assert qwen["verify"]["experts_touched"] == pytest.approx(128, abs=0.1)  # 128 tokens x top-8: nearly all


def test_hybrid_cost_report_counts_attention_pages_and_recurrent_states(tmp_path):
    """--cost --shape qwen3.5-27b (scaled): only the attention layers have pages and K/V; the
    ideal adds the gated delta-net states and tails, read and written once per step and per
    cycle; the figures add up as for a dense target."""
    import contextlib
    import io

    from dflash_jax.engine import EngineSpec, Sampling
    from bench.cost import recurrent_state_bytes

    out = tmp_path / "cost.json"
    with contextlib.redirect_stdout(io.StringIO()):
        assert bench.main(["--cost", "--shape", "qwen3.5-27b", "--scale", "0.0625", "--context", "256",
                           "--batch-size", "2", "--compare-cache-len", "0", "--no-pieces", "--json", str(out)]) == 0
    c = json.loads(out.read_text())["cost"]
    target, drafter = published_configs(0.0625, "float32", "qwen3.5-27b")
    assert c["shape"] == "qwen3.5-27b" and target.num_hidden_layers == 4 and target.num_linear_layers == 3
    lin = target.linear_attention
    per_row = lin.v_heads * lin.k_dim * lin.v_dim * 4 + (lin.conv_kernel - 1) * lin.conv_dim * 4
    assert recurrent_state_bytes(target, 2) == 2 * 3 * 2 * per_row
    for key in ("ar", "dflash"):
        f = c[key]
        corr, ideal = f["correction"], f["ideal"]
        spec = EngineSpec(target=target, drafter=drafter if key == "dflash" else None,
                          block_size=16 if key == "dflash" else 1, sampling=Sampling(), max_new_tokens=16,
                          cache_len=384)
        attention = target.num_attention_layers  # 1 of the 4 layers
        kv_position = target.num_key_value_heads * target.head_dim * 4
        assert ideal["target_kv"] == attention * 2 * 256 * kv_position * 2
        assert ideal["target_state"] == recurrent_state_bytes(target, 2)
        assert corr["target_page_bytes"] == attention * (corr["target_pages"] - 1) * 2 * 128 * kv_position * 2
        assert f["ideal_bytes"] == sum(v for k, v in ideal.items() if k != "bytes")
        assert f["corrected_bytes"] == f["xla_bytes"] + corr["bytes"]
        assert f["verify_len"] == spec.verify_len
    assert c["dflash"]["ideal"]["drafter_kv"] == drafter.model.num_hidden_layers * 2 * 256 * (
        drafter.model.num_key_value_heads * drafter.model.head_dim * 4) * 2
