"""The engine compiled for TPUs on this CPU (`python -m bench --aot`): it compiles, fits,
partitions over several chips without gathering a weight, attends through the Pallas kernel, and
the TPU program streams the q/k/v weights as stored (no transposed copy of a kernel per call), and a
DFlash2 cycle compiles beside the DFlash one.

These need libtpu (`pip install -e '.[tpu]'`; .ci/run installs it): without it they are skipped,
with that reason. The multi-chip compiles (four chips, MoE expert parallelism) and the decoding loop's
TPU options compiled both ways are `-m heavy`."""

import importlib.util
import json
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                reason="libtpu is not installed: pip install -e '.[tpu]' to compile for TPUs")


def aot(tmp_path, *flags, check=True):
    out = tmp_path / "aot.json"
    p = subprocess.run([sys.executable, "-m", "bench", "--aot", *flags, "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    if check:
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
        return p, json.loads(out.read_text())["aot"]
    return p, None


def test_tiny_engine_compiles_for_one_v5e_chip_with_no_weight_relaid_out(tmp_path):
    hlo = tmp_path / "hlo"
    p, r = aot(tmp_path, "v5e:1x1", "--scale", "0.05", "--context", "128", "--compare-cache-len", "0",
               "--hlo", str(hlo))
    assert r["chips"] == 1 and r["mesh"] == {"data": 1, "model": 1}
    for name in ("prefill", "ar", "dflash"):
        f = r["programs"][name]
        assert f["compiled"] and f["fits"], (name, f)
        assert 0 < f["memory"]["arguments"] <= f["memory"]["total"] < r["chip_spec"]["hbm"]
        assert f["bytes"] > 0 and f["flops"] > 0
        assert not any(f["collectives"][c] for c in ("all-reduce", "all-gather", "all-to-all")), f["collectives"]
        assert (hlo / f"{name}.hlo.txt").exists()
        # attention is the Pallas kernel, compiled through Mosaic: one custom call per attention layer
        kernels = re.findall(r'custom_call_target="tpu_custom_call"', (hlo / f"{name}.hlo.txt").read_text())
        assert len(kernels) >= 2, (name, len(kernels))
    assert r["compare"] is None
    # the ideal: the target's weights but its embedding table (a lookup reads rows), plus the drafter's for a cycle
    ar_ideal, dflash_ideal = (r["programs"][k]["ideal"] for k in ("ar", "dflash"))
    assert ar_ideal["target_weights"] < r["target_weight_bytes"] and ar_ideal["target_weights"] > 0.5 * r["target_weight_bytes"]
    assert dflash_ideal["bytes"] > ar_ideal["bytes"] + dflash_ideal["drafter_weights"] * 0.99
    assert r["streaming_rate"] > 0
    # A norm or RoPE fused into a projection's dot made the TPU compiler copy every q/k/v kernel into a
    # transposed layout before the loop (model.layers.unfused prevents it).
    for name in ("ar", "dflash"):
        text = (hlo / f"{name}.hlo.txt").read_text()
        copied = re.findall(r"copy\(%tparams__model____layers_\d+____self_attn____[qkv]_proj____kernel", text)
        assert not copied, (name, copied[:4])
    assert "AR step" in p.stdout and "HBM per chip" in p.stdout


@pytest.mark.heavy  # a third TPU compile; the everyday suite compiles the chain's cycle through the kernel
def test_a_tree_cycle_compiles_for_one_v5e_chip_through_the_kernel(tmp_path):
    """--tree-budgets 8: the DFlash cycle verifying a draft tree of 8 nodes compiles beside the chain,
    its verify of 9 tokens attends through the Pallas kernel (the "tree" mask kind), and the report
    places it against the chip's roof."""
    hlo = tmp_path / "hlo"
    p, r = aot(tmp_path, "v5e:1x1", "--scale", "0.05", "--context", "128", "--compare-cache-len", "0",
               "--programs", "dflash", "--tree-budgets", "8", "--hlo", str(hlo))
    chain, tree = r["programs"]["dflash"], r["programs"]["tree8"]
    assert tree["compiled"] and tree["fits"] and tree["tree_budget"] == 8 and tree["verify_len"] == 9
    assert chain["tree_budget"] == 0 and chain["verify_len"] == 16
    kernels = re.findall(r'custom_call_target="tpu_custom_call"', (hlo / "tree8.hlo.txt").read_text())
    assert len(kernels) >= 3, len(kernels)  # the target's two layers and the drafter's one
    assert tree["roofline"]["intensity"] > 0 and "DFlash tree 8" in p.stdout


@pytest.mark.heavy  # two TPU compiles; the everyday suite compiles the DFlash cycle
def test_the_constrained_cycle_compiles_beside_the_dflash_cycle_with_its_masks_in_place(tmp_path):
    """--programs dflash,constrained: the DFlash cycle of an engine holding constraints compiles for a
    v5p beside the plain one, the report gives constrained / DFlash, and the pool's masks are never
    copied into another layout (the host's bit order made the compiler unpack them across lanes;
    docs/structured-output.md has the full-size figure)."""
    hlo = tmp_path / "hlo"
    p, r = aot(tmp_path, "v5p:1x1x1", "--scale", "0.1", "--context", "128", "--programs", "dflash,constrained",
               "--compare-cache-len", "0", "--hlo", str(hlo))
    c, d = r["programs"]["constrained"], r["programs"]["dflash"]
    assert c["compiled"] and c["fits"] and c["constraint_states"] == 512 and d["constraint_states"] == 0
    x = r["constrained_over_dflash"]
    assert x["seconds"] == c["seconds"] / d["seconds"] and x["seconds"] > 1.0 and x["bytes"] > 1.0
    assert "constrained / DFlash cycle" in p.stdout
    masks = re.findall(r"= u32\[\d+,\d+\]\{[^}]*\} copy\(", (hlo / "constrained.hlo.txt").read_text())
    assert not masks, masks[:3]


@pytest.mark.heavy  # two TPU compiles (21 s); the everyday suite compiles the DFlash cycle
def test_a_dflash2_cycle_compiles_for_one_v5p_chip_beside_the_dflash_cycle(tmp_path):
    """--shape qwen3.8-27b (scaled): the DFlash2 cycle (dynamic convolutions, the candidate selector's
    walk) compiles for a v5p beside the DFlash cycle of the same drafter without them, and the report
    gives both and DFlash2 / DFlash, the DFlash2 ideal counting the selector's two codebooks whole. The
    walk leaves no loop in the program (as many while loops as the DFlash cycle's), the selector's
    top-k is the chip's partial reduction (approx_max_k), and no drafter weight is copied into another
    layout: with the convolution's channels split into groups, the compiler copied the o_proj kernels
    (and at batch 1 the down_proj ones) into a transposed layout every call."""
    from dflash_jax.shapes import published_configs

    hlo = tmp_path / "hlo"
    p, r = aot(tmp_path, "v5p:1x1x1", "--shape", "qwen3.8-27b", "--scale", "0.0625", "--context", "128",
               "--programs", "ar,dflash", "--compare-cache-len", "0", "--hlo", str(hlo))
    d2, d1 = r["programs"]["dflash2"], r["programs"]["dflash"]
    for f in (d2, d1):
        assert f["compiled"] and f["fits"] and f["seconds"] > 0 and f["ratio"] > 0, f
        assert f["block_size"] == 8 and f["verify_len"] == 8
    _, drafter = published_configs(0.0625, "bfloat16", "qwen3.8-27b")
    codebooks = 2 * drafter.model.vocab_size * drafter.dflash2.selector_rank * 2
    assert d2["selector_codebooks"] == codebooks and d1["selector_codebooks"] == 0
    assert d2["ideal"]["drafter_weights"] - d1["ideal"]["drafter_weights"] >= codebooks
    x = r["dflash2_over_dflash"]
    assert x["seconds"] == pytest.approx(d2["seconds"] / d1["seconds"]) and x["ideal"] > 1
    assert r["dflash2_cycle_over_step"] == pytest.approx(d2["seconds"] / r["programs"]["ar"]["seconds"])
    assert d2["while_loops"] == d1["while_loops"], (d2["while_loops"], d1["while_loops"])
    assert "PartialReduce" in d2["custom_calls"] and "PartialReduce" not in d1["custom_calls"]
    copied = re.findall(r"copy\(%dparams__\S+?____kernel", (hlo / "dflash2.hlo.txt").read_text())
    assert not copied, copied[:4]
    assert "DFlash2 cycle, B=8" in p.stdout and "DFlash2 / DFlash" in p.stdout


@pytest.mark.heavy
def test_four_chips_split_the_weights_and_gather_none(tmp_path):
    """v5e:2x2 with every chip on `model`: heads, MLP and vocabulary split four ways, so each chip
    holds about a quarter of the weights; the step all-reduces activations and all-gathers no weight."""
    _, r = aot(tmp_path, "v5e:2x2", "--scale", "0.125", "--context", "128", "--programs", "ar",
               "--compare-cache-len", "512")
    f = r["programs"]["ar"]
    assert set(r["compare"]) == {"cache_len", "ar"} and r["compare"]["cache_len"] == 512
    assert r["compare"]["ar"]["memory"]["arguments"] > f["memory"]["arguments"]  # the larger cache
    assert r["chips"] == 4 and r["mesh"] == {"data": 1, "model": 4}
    assert f["compiled"] and f["fits"]
    assert f["memory"]["arguments"] < 0.5 * r["target_weight_bytes"]
    assert f["collectives"]["all-reduce"] > 0
    weights = {s for s in f["collectives"]["all_gathered"] if re.match(r"bf16\[\d+,\d+\]", s)}
    assert not weights, weights
    assert r["streaming_rate"] is None  # a partitioned program's estimate is not a per-chip time


@pytest.mark.heavy
def test_moe_experts_run_where_they_are_stored(tmp_path):
    """A Qwen3-30B-A3B-shaped target (128 experts, scaled widths) on v5e:2x2, model=4: each chip runs
    its own 32 experts (moe.expert_parallel). XLA's partitioner cannot split the grouped matmul
    (`ragged_dot`) over its groups: without the shard_map every step all-gathered every layer's
    expert stacks. (The CPU backend expands ragged_dot into a dense dot that partitions, so only a
    TPU compile shows it.)"""
    _, r = aot(tmp_path, "v5e:2x2", "--shape", "qwen3-30b-a3b", "--scale", "0.05", "--context", "128",
               "--programs", "ar", "--compare-cache-len", "0")
    f = r["programs"]["ar"]
    assert f["compiled"] and f["fits"]
    stacks = [s for s in f["collectives"]["all_gathered"] if re.match(r"\w+\[128,\d+,\d+\]", s)]
    assert not stacks, stacks
    assert f["collectives"]["all-reduce"] > 0


def test_a_program_that_does_not_fit_is_reported_not_raised(tmp_path):
    """A cache of 64 rows x 1M positions cannot fit a v5e chip: the compile fails with
    RESOURCE_EXHAUSTED, and the report says so with the HBM the compiler asked for."""
    p, r = aot(tmp_path, "v5e:1x1", "--scale", "0.05", "--programs", "ar", "--cache-len", "1048576",
               "--batch-size", "64", "--context", "128", "--compare-cache-len", "0")
    f = r["programs"]["ar"]
    assert not f["compiled"] and "RESOURCE_EXHAUSTED" in f["error"]
    assert re.fullmatch(r"needs [\d.]+G of 15.75G HBM", f["asked"]), f["asked"]
    assert "does not compile" in p.stdout


def test_bad_topology_and_mesh_are_one_line_errors(tmp_path):
    p, _ = aot(tmp_path, "v9:1x1", check=False)
    assert p.returncode != 0 and p.stderr.strip().splitlines()[-1].startswith("error: unknown TPU topology 'v9:1x1'")
    p, _ = aot(tmp_path, "v5e:2x2", "--mesh", "model=3", check=False)
    assert p.returncode != 0 and "error:" in p.stderr.strip().splitlines()[-1]


def _matvec_chain(n: int, d: int = 4096, **jit_kwargs):
    """A chain of batch-8 matvecs over n separate [d, d] bfloat16 weights, compiled for one v5p chip."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from dflash_jax.aot import topology

    mesh = Mesh(np.array(topology("v5p:1x1x1").devices).reshape(1), ("x",))

    def chain(x, *ws):
        for w in ws:
            x = (x @ w).astype(x.dtype)
        return x

    sds = lambda shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=NamedSharding(mesh, P()))  # noqa: E731
    jax.config.update("jax_enable_compilation_cache", False)  # no TPU executable in the CPU tests' cache
    try:
        return jax.jit(chain, **jit_kwargs).trace(sds((8, d)), *[sds((d, d))] * n).lower().compile()
    finally:
        jax.config.update("jax_enable_compilation_cache", True)


def test_prefetched_weights_are_counted_five_times():
    """The report's HBM figure subtracts 4 x the bytes the HLO prefetches into on-chip memory:
    that is how the TPU compiler's cost analysis counts them. A chain of matvecs over separate
    [4096, 4096] weights, p of them prefetched: bytes accessed = (n + 4 p) weights."""
    from dflash_jax.aot import cost_of, prefetched_bytes

    n, weight = 8, 4096 * 4096 * 2
    compiled = _matvec_chain(n)
    prefetched = prefetched_bytes(compiled.as_text())
    assert prefetched > 0 and prefetched % weight == 0, prefetched
    # (+ the [8, 4096] activations: 0.1 %)
    assert cost_of(compiled)["bytes"] == pytest.approx((n + 4 * prefetched // weight) * weight, rel=0.005)
    assert cost_of(compiled)["bytes"] > (n + 1) * weight  # without the correction it would be off


@pytest.mark.heavy
def test_the_decoding_loop_compiles_for_a_tpu_without_prefetching_weights(tmp_path, monkeypatch):
    """The engine's TPU compiler options (dflash_jax.platform.DECODE_COMPILER_OPTIONS) stop the
    compiler prefetching the weights a step reads once into on-chip memory, which its estimate
    charged five times; DFLASH_TPU_PREFETCH_WEIGHTS=1 restores the default. run_cycles takes the
    options when traced for a TPU, and not for the CPU."""
    from dflash_jax.engine.step import run_cycles
    from dflash_jax.platform import DECODE_COMPILER_OPTIONS, compiling_for

    assert run_cycles.compiler_options() == {}
    with compiling_for("tpu"):
        assert run_cycles.compiler_options() == DECODE_COMPILER_OPTIONS["tpu"] != {}
    flags = ("v5p:1x1x1", "--scale", "0.1", "--context", "128", "--programs", "ar", "--compare-cache-len", "0")
    tuned = aot(tmp_path, *flags)[1]["programs"]["ar"]
    monkeypatch.setenv("DFLASH_TPU_PREFETCH_WEIGHTS", "1")
    default = aot(tmp_path, *flags)[1]["programs"]["ar"]
    assert default["prefetched"] > 0 and tuned["prefetched"] == 0, (default["prefetched"], tuned["prefetched"])
    assert tuned["seconds"] < default["seconds"] and tuned["bytes"] < default["bytes"]


def test_the_batch_sweep_picks_the_best_draft_length_and_finds_the_ridge():
    """--batch-sweep's analysis, on made-up figures (nothing compiled): the break-even tau of each K is
    t_cycle(K) / t_AR, the policy's choice is the K of the most expected tokens/s (here K = 3: K = 15's
    cycle costs 3x K = 3's while its rows gain less than twice the tokens), and a program crosses the
    ridge between the sweep's batches where its flops per byte meet it (log-log)."""
    from dflash_jax.engine.speculation import expected_tokens, rates_for_tau

    from bench.aot_sweep import policy_at, ridge_crossing

    rates = rates_for_tau(6.49, 15)
    fig = lambda s: dict(compiled=True, fits=True, seconds=s)  # noqa: E731
    p = policy_at(dict(ar=fig(1.0), k0=fig(1.05), k3=fig(1.2), k15=fig(3.6),
                       k7=dict(compiled=False, fits=False)), [3, 7, 15], rates)
    assert p["tau_break"] == pytest.approx({"0": 1.05, "3": 1.2, "15": 3.6})
    assert p["best"] == p["choice"] == 3 and p["choice_over_best"] == 1.0
    assert p["tokens_per_second"]["3"] == pytest.approx(expected_tokens(rates, 3) / 1.2)
    assert p["best_over_ar"] == pytest.approx(expected_tokens(rates, 3) / 1.2)
    assert ridge_crossing([(1, 10.0), (8, 80.0), (64, 640.0)], 160.0) == dict(first_batch=64, batch=pytest.approx(16.0))
    assert ridge_crossing([(1, 1.0), (8, 2.0)], 160.0) == dict(first_batch=None, batch=None)


@pytest.mark.heavy  # six small TPU compiles (about 1.5 min on 2 cores)
def test_a_batch_sweep_reports_every_program_and_the_policys_choice(tmp_path):
    """--batch-sweep 1,8 --draft-sweep 15 (scaled): AR, the K = 0 cycle and K = 15 compile at each
    batch; each has its estimate, flops per byte and the ideal; the policy's choice is the K of the most
    projected tokens/s from those estimates, and K = 0's ideal reads no more of the drafter than its context
    projections."""
    from dflash_jax.engine.speculation import expected_tokens

    p, r = aot(tmp_path, "v5p:1x1x1", "--scale", "0.05", "--context", "128", "--batch-sweep", "8,1",
               "--draft-sweep", "15")
    assert r["batches"] == [1, 8] and r["draft_sweep"] == [15]
    assert set(r["programs"]) == {"ar", "k0", "k15"} and set(r["crossings"]) == set(r["programs"])
    for label, by in r["programs"].items():
        for n in ("1", "8"):
            f = by[n]
            assert f["compiled"] and f["fits"] and f["seconds"] > 0 and f["roofline"]["intensity"] > 0, (label, n)
            assert f["ratio"] > 0 and f["ideal"]["bytes"] > 0
    k0, k15 = r["programs"]["k0"]["1"]["ideal"], r["programs"]["k15"]["1"]["ideal"]
    assert 0 < k0["drafter_weights"] < k15["drafter_weights"] and k0["lm_head_again"] == 0
    for n in ("1", "8"):
        pol, secs = r["policy"][n], {k: r["programs"][f"k{k}"][n]["seconds"] for k in (0, 15)}
        tps = {k: expected_tokens(r["rates"], k) / s for k, s in secs.items()}
        assert pol["choice"] == max(tps, key=tps.get) == pol["best"] and pol["choice_over_best"] == 1.0
        assert pol["tau_break"]["15"] == pytest.approx(secs[15] / r["programs"]["ar"][n]["seconds"])
    assert "break-even tau" in p.stdout and (tmp_path / "aot.partial.json").exists()
