"""Mixture-of-experts targets (Qwen3-MoE, gpt-oss): the block against a dense reference,
MXFP4 experts, bfloat16, conversion, decoding against transformers, bad configs.

Logits and taps against transformers in float32 are in test_model_parity (its families
include both); DFlash greedy and sampling with MoE targets in test_spec_decode; meshes in
test_scale.
"""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from dflash_jax import ConfigError, forward, init_cache, load_target
from dflash_jax.config import ModelConfig, MoeConfig
from dflash_jax.engine import BatchEngine
from dflash_jax.errors import CheckpointError
from dflash_jax.families.gpt_oss import FP4_VALUES, dequantize_mxfp4
from dflash_jax.model import MoE
from dflash_jax.model import moe as moe_module
from dflash_jax.model.moe import Experts
from dflash_jax.families import model_config
from tiny import (MOE_FAMILIES, assert_plain_greedy_equals_generate, make_model, save_model, train_cli_on_regenerated,
                  write_random_drafter)

REPO = Path(__file__).resolve().parent.parent
IDS = np.random.RandomState(3).randint(0, 160, (2, 30))


@pytest.fixture(scope="module")
def hf_moe(tmp_path_factory):
    """{family: (torch model, HF directory)} of the tiny MoE checkpoints."""
    root = tmp_path_factory.mktemp("moe")
    out = {}
    for family in MOE_FAMILIES:
        model = make_model(family, seed=7)
        out[family] = (model, save_model(model, root / family))
    return out


def torch_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.float().numpy()


# --------------------------------------------------------------------------- the block


def numpy_moe(x, params, moe: MoeConfig):
    """Every expert on every token, then the routed ones picked and weighted: the definition
    the grouped (sorted, ragged) computation must equal."""
    logits = x @ params["router"]["kernel"] + params["router"].get("bias", 0)
    k = moe.top_k
    if moe.router == "softmax_topk":
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        experts = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
        weights = np.take_along_axis(probs, experts, -1)
        if moe.norm_topk_prob:
            weights /= weights.sum(-1, keepdims=True)
    else:
        experts = np.argsort(-logits, axis=-1, kind="stable")[:, :k]
        top = np.take_along_axis(logits, experts, -1)
        weights = np.exp(top - top.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
    ex = params["experts"]
    outs = []
    for e in range(moe.num_experts):
        if moe.fused_gate_up:
            gu = x @ ex["gate_up_proj"][e] + ex["gate_up_proj_bias"][e]
            gate, up = gu[:, 0::2], gu[:, 1::2]
            gate, up = np.minimum(gate, moe.swiglu_limit), np.clip(up, -moe.swiglu_limit, moe.swiglu_limit)
            h = (up + 1) * gate / (1 + np.exp(-moe.swiglu_alpha * gate))
            outs.append(h @ ex["down_proj"][e] + ex["down_proj_bias"][e])
        else:
            gate, up = x @ ex["gate_proj"][e], x @ ex["up_proj"][e]
            outs.append((gate / (1 + np.exp(-gate)) * up) @ ex["down_proj"][e])
    every = np.stack(outs, 1)  # [N, experts, hidden]
    return (np.take_along_axis(every, experts[..., None], 1) * weights[..., None]).sum(1)


MOE_BLOCKS = {
    "qwen3_moe": MoeConfig(num_experts=8, top_k=3, intermediate_size=16, norm_topk_prob=True),
    "gpt_oss": MoeConfig(num_experts=8, top_k=2, intermediate_size=16, router="topk_softmax", router_bias=True,
                         expert_bias=True, fused_gate_up=True, activation="clamped_swiglu", swiglu_limit=0.5),
}


@pytest.mark.parametrize("family", sorted(MOE_BLOCKS))
def test_grouped_experts_equal_every_expert_on_every_token(family):
    moe = MOE_BLOCKS[family]
    config = ModelConfig(model_type=family, vocab_size=8, hidden_size=24, intermediate_size=8, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8, moe=moe, sparse_layers=(True,))
    x = jax.random.normal(jax.random.PRNGKey(0), (3, 11, 24))
    params = MoE(config).init(jax.random.PRNGKey(1), x)["params"]
    params = jax.tree.map(lambda p: p + 0.3 * jax.random.normal(jax.random.PRNGKey(2), p.shape), params)  # biases too
    got = np.asarray(MoE(config).apply({"params": params}, x))
    want = numpy_moe(np.asarray(x).reshape(-1, 24), jax.tree.map(np.asarray, params), moe).reshape(3, 11, 24)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    # Routing spread the 33 tokens over most experts, so the groups were really ragged.
    router = params["router"]
    logits = np.asarray(x).reshape(-1, 24) @ np.asarray(router["kernel"]) + np.asarray(router.get("bias", 0))
    assert len(set(np.argsort(-logits, -1)[:, :moe.top_k].ravel())) >= 6


# --------------------------------------------------------------------------- the touched experts


TOUCHED_BLOCKS = {  # 16 experts, so a few tokens touch only some of them
    **{f: dataclasses.replace(m, num_experts=16) for f, m in MOE_BLOCKS.items()},
    "gemma4": MoeConfig(num_experts=16, top_k=2, intermediate_size=16, norm_topk_prob=True, gate_up_halves=True,
                        router_input_norm=True, per_expert_scale=True, activation="gelu_tanh"),
    "deepseek_v3": MoeConfig(num_experts=16, top_k=3, intermediate_size=16, router="sigmoid_grouped", n_group=4,
                             topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5, shared_expert_size=16,
                             shared_expert_gated=False, router_float32=True),
}


def block_config(moe: MoeConfig, dtype="float32") -> ModelConfig:
    return ModelConfig(model_type="test", vocab_size=8, hidden_size=24, intermediate_size=8, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=8, moe=moe, sparse_layers=(True,),
                       dtype=dtype)


def experts_on(path, config, params, tokens, weights, experts):
    with moe_module.override(path):
        return np.asarray(jax.jit(lambda p, *a: Experts(config).apply({"params": p}, *a))(params, tokens, weights, experts))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", sorted(TOUCHED_BLOCKS))
def test_touched_experts_equal_the_grouped_matmuls(family, dtype):
    """The touched-experts path (each distinct expert routed to, picked from the stack, over every
    token, weighted by the routing) equals the grouped one for random routing: tokens sharing
    experts, a token naming one expert twice, 3 tokens touching some of the 16 experts (padding
    slots) and 9 touching every one (the whole stack, nothing picked). Every activation and
    gate/up layout, biases included."""
    moe = TOUCHED_BLOCKS[family]
    config = block_config(moe, dtype)
    rs = np.random.RandomState(0)
    params = Experts(config).init(jax.random.PRNGKey(1), jnp.zeros((1, 24)), jnp.zeros((1, moe.top_k)),
                                  jnp.zeros((1, moe.top_k), jnp.int32))["params"]
    params = jax.tree.map(lambda p: (p + 0.3 * jax.random.normal(jax.random.PRNGKey(2), p.shape)).astype(p.dtype), params)
    for n in (3, 9):
        tokens = jnp.asarray(rs.standard_normal((n, 24)), config.dtype)
        weights = jnp.asarray(rs.uniform(0.1, 1, (n, moe.top_k)), jnp.float32)
        experts = rs.choice([1, 4, 5, 11, 15], (n, moe.top_k)) if n == 3 else rs.randint(0, 16, (n, moe.top_k))
        experts[0, :2] = 4  # one token naming expert 4 twice
        experts = jnp.asarray(experts, jnp.int32)
        assert moe_module.touched_path(n, moe) == (n * moe.top_k < 16)
        got = experts_on("touched", config, params, tokens, weights, experts)
        want = experts_on("grouped", config, params, tokens, weights, experts)
        assert got.dtype == want.dtype == np.float32 and got.shape == (n, 24)
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == "float32" else dict(atol=2e-2 * np.abs(want).max(), rtol=0)
        np.testing.assert_allclose(got, want, **tol)
        assert np.abs(want).max() > 0.1


@pytest.mark.parametrize("family", sorted(TOUCHED_BLOCKS))
def test_tiled_experts_equal_the_grouped_matmuls(family, monkeypatch):
    """The tiled path (the assignments sorted by expert, cut into tiles of one expert's rows, one
    product a tile) equals the grouped one: tiles of 2 rows (an expert's rows over several tiles, a
    last tile part padding) and of 32 (each expert's rows in one), 3 tokens touching some of the 16
    experts and 20 touching most, a token naming one expert twice."""
    moe = TOUCHED_BLOCKS[family]
    config = block_config(moe)
    rs = np.random.RandomState(5)
    params = Experts(config).init(jax.random.PRNGKey(1), jnp.zeros((1, 24)), jnp.zeros((1, moe.top_k)),
                                  jnp.zeros((1, moe.top_k), jnp.int32))["params"]
    params = jax.tree.map(lambda p: p + 0.3 * jax.random.normal(jax.random.PRNGKey(2), p.shape), params)
    for rows in (2, 32):
        monkeypatch.setattr(moe_module, "TILE_ROWS", rows)
        for n in (3, 20):
            tokens = jnp.asarray(rs.standard_normal((n, 24)), jnp.float32)
            weights = jnp.asarray(rs.uniform(0.1, 1, (n, moe.top_k)), jnp.float32)
            experts = rs.choice([1, 4, 5, 11, 15], (n, moe.top_k)) if n == 3 else rs.randint(0, 16, (n, moe.top_k))
            experts[0, :2] = 4
            experts = jnp.asarray(experts, jnp.int32)
            got = experts_on("tiled", config, params, tokens, weights, experts)
            want = experts_on("grouped", config, params, tokens, weights, experts)
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
            assert np.abs(want).max() > 0.1


@pytest.mark.parametrize("family", sorted(TOUCHED_BLOCKS))
def test_the_block_at_decode_equals_every_expert_on_every_token(family):
    """The whole block (router, touched experts, shared expert) at 2 tokens, which take the touched
    path, against the grouped path and, for the two routers numpy_moe knows, the definition."""
    moe = TOUCHED_BLOCKS[family]
    config = block_config(moe)
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 1, 24))
    params = MoE(config).init(jax.random.PRNGKey(1), x)["params"]
    params = jax.tree.map(lambda p: p + 0.3 * jax.random.normal(jax.random.PRNGKey(2), p.shape), params)
    assert moe_module.touched_path(2, moe)
    got = np.asarray(MoE(config).apply({"params": params}, x))
    with moe_module.override("grouped"):
        np.testing.assert_allclose(got, np.asarray(MoE(config).apply({"params": params}, x)), atol=1e-5, rtol=1e-5)
    if family in MOE_BLOCKS:
        want = numpy_moe(np.asarray(x).reshape(-1, 24), jax.tree.map(np.asarray, params), moe).reshape(got.shape)
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_the_switch_between_touched_and_grouped():
    """The touched path while tokens x top_k < experts (decode, a small batch's verify), the grouped
    one from there on (prefill), for the published shapes; `override` forces either."""
    from dflash_jax.families import model_config as parse
    from dflash_jax.shapes import PUBLISHED_TARGETS

    deepseek, oss = (parse(PUBLISHED_TARGETS[s]).moe for s in ("deepseek-v3", "gpt-oss-120b"))
    assert [moe_module.touched_path(n, deepseek) for n in (1, 8, 16, 31, 32, 128)] == [True] * 4 + [False] * 2
    assert [moe_module.touched_path(n, oss) for n in (1, 8, 31, 32, 4096)] == [True] * 3 + [False] * 2
    with moe_module.override("touched"):
        assert moe_module.touched_path(4096, oss)
    with moe_module.override("grouped"):
        assert not moe_module.touched_path(1, oss)
    assert moe_module.touched_path(4096, oss) is False
    # stacks kept quantized: touched (every expert) up to QUANTIZED_TOUCHED_TOKENS, then grouped
    assert [moe_module.touched_path(n, deepseek, True) for n in (8, 128, 256, 257, 4096)] == [True] * 3 + [False] * 2
    # tiled: products that cost more than a dot a row (MXFP4), every local expert run, tiles reading at
    # most 1.25x the experts: gpt-oss-120b's verify of 8 x 16 tokens on one chip, not on four (48 tiles for 32)
    assert [moe_module.tiled_path(n, oss, 2) for n in (8, 31, 32, 128)] == [False, False, True, True]
    assert not moe_module.tiled_path(128, oss, 1) and not moe_module.tiled_path(128, oss, 2, local=32)
    assert not moe_module.tiled_path(128, deepseek, 1)
    with moe_module.override("tiled"):
        assert moe_module.tiled_path(1, oss) and not moe_module.touched_path(1, oss)
    with pytest.raises(ValueError, match="unknown MoE path 'fast'"):
        with moe_module.override("fast"):
            pass


# -m heavy (an engine compiled twice, 22 s afresh): the everyday suite takes the touched path through an engine
# in tests/test_mxfp4.py (stacks kept quantized decode and verify touched) and per block in this file
@pytest.mark.parametrize("name", [pytest.param("qwen3_moe-v8", marks=pytest.mark.heavy),
                                  pytest.param("gpt_oss-v8", marks=pytest.mark.heavy)])
def test_decode_and_verify_take_the_touched_path_and_equal_a_full_recompute(name, monkeypatch):
    """A MoE target of 32 experts (top 2) in the engine: its decode steps (2 rows) and verify passes
    (2 rows x block 4) take the touched path, prefill the grouped one, and plain greedy decoding
    equals a full recompute of every step (all grouped), and DFlash equals plain."""
    from dflash_jax.model import init_params
    from fixtures import SETUPS, perturbed, prompts, setup

    target, _, drafter, dparams = setup(name)
    target = target.replace(moe=dataclasses.replace(target.moe, num_experts=32))
    tparams = perturbed(init_params(target, jax.random.PRNGKey(SETUPS[name][5])))
    calls, real = [], moe_module.touched_path
    monkeypatch.setattr(moe_module, "touched_path", lambda n, moe, *a: calls.append((n, real(n, moe, *a))) or real(n, moe, *a))
    prompt_list = [list(p) for p in prompts(name)[:6]]
    new = 12
    plain = BatchEngine(target, tparams, batch_size=2, max_new_tokens=new, max_prompt_len=32, page_size=16)
    plain_out = [r.output_ids for r in sorted(plain.generate(prompt_list), key=lambda r: r.index)]
    spec = BatchEngine(target, tparams, drafter, dparams, block_size=4, batch_size=2, max_new_tokens=new,
                       max_prompt_len=32, page_size=16, speculation="fixed")
    spec_res = sorted(spec.generate(prompt_list), key=lambda r: r.index)
    assert (2, True) in calls and (2 * 4, True) in calls, sorted(set(calls))  # decode, verify
    assert any(not touched for _, touched in calls)  # prefill
    seqs = [list(p) for p in prompt_list]  # the reference: every step recomputed whole, grouped
    width = max(map(len, seqs)) + new
    for _ in range(new):
        ids = np.zeros((len(seqs), width), np.int32)
        for i, s in enumerate(seqs):
            ids[i, :len(s)] = s
        logits = np.asarray(forward(tparams, target, jnp.asarray(ids), init_cache(target, len(seqs), width)).logits)
        for i, s in enumerate(seqs):
            s.append(int(np.argmax(logits[i, len(s) - 1])))
    assert not moe_module.touched_path(len(seqs) * width, target.moe)
    assert plain_out == [s[len(p):] for s, p in zip(seqs, prompt_list)]
    assert [r.output_ids for r in spec_res] == plain_out
    assert max(a for r in spec_res for a in r.acceptance_lengths) > 1


EXPERT_PARALLEL = """
import json, sys
import jax, jax.numpy as jnp, numpy as np
sys.path.insert(0, "tests")
from dflash_jax.config import ModelConfig
from dflash_jax.model import MoE
from dflash_jax.model import moe as moe_module
from dflash_jax.model.moe import Experts
from dflash_jax.model import moe as moe_module
from dflash_jax.sharding import make_mesh, tracing_on
from jax.sharding import NamedSharding, PartitionSpec as P
from test_moe import TOUCHED_BLOCKS, block_config

out = {}
calls, real = [], moe_module.touched_path
moe_module.touched_path = lambda n, moe, *a: calls.append(real(n, moe, *a)) or real(n, moe, *a)
for family in sys.argv[1:]:
    config = block_config(TOUCHED_BLOCKS[family])
    for n in (2, 10):
        x = jax.random.normal(jax.random.PRNGKey(n), (1, n, 24))
        params = MoE(config).init(jax.random.PRNGKey(1), x)["params"]
        params = jax.tree.map(lambda p: p + 0.3 * jax.random.normal(jax.random.PRNGKey(2), p.shape), params)
        want = np.asarray(jax.jit(lambda p, x: MoE(config).apply({"params": p}, x))(params, x))
        for spec in ("model=2", "data=2,model=4"):
            mesh = make_mesh(spec)
            on = jax.device_put((params, x), NamedSharding(mesh, P()))
            with tracing_on(mesh):
                got = jax.jit(lambda p, x: MoE(config).apply({"params": p}, x))(*on)
            out[f"{family} {n} {spec}"] = float(np.abs(np.asarray(got) - want).max() / np.abs(want).max())
            if n == 10:  # the tiled path over each device's own experts, tiles of 2 rows
                moe_module.TILE_ROWS = 2
                with tracing_on(mesh), moe_module.override("tiled"):
                    got = jax.jit(lambda p, x: MoE(config).apply({"params": p}, x))(*on)
                moe_module.TILE_ROWS = 32
                out[f"{family} {n} {spec} tiled"] = float(np.abs(np.asarray(got) - want).max() / np.abs(want).max())
print(json.dumps({"errors": out, "touched": calls}))
"""


# -m heavy: an 8-device subprocess compiling afresh (15 s); the everyday suite has the touched path on one
# device (test_touched_experts_equal_the_grouped_matmuls, the decode-and-verify engine test)
@pytest.mark.parametrize("families", [pytest.param(("gpt_oss", "qwen3_moe"), marks=pytest.mark.heavy),
                                      pytest.param(("deepseek_v3", "gemma4"), marks=pytest.mark.heavy)])
def test_expert_parallel_touched_and_grouped_equal_one_device(families):
    """The block with its 16 experts split over `model` (2 or 4 devices; 8 CPU devices in a
    subprocess): at 2 tokens (touched: with 8 experts a device, some of them picked, padding slots
    included; with 4, all of them) and at 10 (grouped, and tiled over each device's experts), the
    block equals one device's."""
    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8",
           "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", EXPERT_PARALLEL, *families], capture_output=True, text=True, env=env,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(out["errors"]) == len(families) * 2 * 3
    bad = {k: e for k, e in out["errors"].items() if not e < 1e-5}
    assert not bad, bad
    assert True in out["touched"] and False in out["touched"]


# --------------------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_bfloat16_checkpoint_tracks_transformers_in_bfloat16(family, tmp_path):
    """A bfloat16 checkpoint runs in bfloat16 and tracks transformers running the same
    checkpoint in bfloat16. Not at every position: where two experts' router scores are
    within a bfloat16 rounding, either side may pick the other expert (measured on these
    checkpoints: 1 or 2 of 60 positions, on ours or on transformers' side alike), so the
    bound holds at 9 positions in 10 and the typical position is within 2%."""
    save_model(make_model(family, seed=7), tmp_path, dtype=torch.bfloat16)
    ref = torch_logits(make_model(family, seed=7).to(torch.bfloat16), IDS)
    config, params = load_target(tmp_path)
    assert config.dtype == "bfloat16"
    experts = params["model"]["layers_0"]["mlp"]["experts"]
    assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree.leaves(experts))
    out = np.asarray(forward(params, config, jnp.asarray(IDS, jnp.int32), init_cache(config, 2, 32)).logits)
    err = np.abs(out - ref).max(-1) / np.abs(ref).max()  # per position
    assert np.mean(err < 0.05) >= 0.9 and np.median(err) < 0.02, np.round(np.sort(err)[-6:], 3)


def test_converted_moe_checkpoints_give_identical_logits(hf_moe, tmp_path):
    from dflash_jax.convert import main as convert_main

    for family in MOE_FAMILIES:
        _, path = hf_moe[family]
        out = tmp_path / family
        assert convert_main(["--hf", str(path), "--out", str(out), "--quiet"]) == 0
        (c1, p1), (c2, p2) = load_target(path), load_target(out)
        assert c1 == c2
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), p1, p2)


def test_qwen3_moe_layers_are_sparse_or_dense_as_configured(hf_moe):
    config, params = load_target(hf_moe["qwen3_moe"][1])
    assert config.sparse_layers == (True, False, True, True)  # mlp_only_layers=[1]
    assert "experts" in params["model"]["layers_0"]["mlp"] and "up_proj" in params["model"]["layers_1"]["mlp"]
    assert params["model"]["layers_2"]["mlp"]["experts"]["gate_proj"].shape == (6, 64, 32)
    gpt = load_target(hf_moe["gpt_oss"][1])[0]
    assert gpt.sliding_windows == (8, None, 8, None) and gpt.attention_sinks and gpt.rope.type == "yarn"


# --------------------------------------------------------------------------- MXFP4


def quantize_mxfp4(w):
    """float [experts, out, in] -> (blocks [experts, out, in / 32, 16], scales [experts, out,
    in / 32]) uint8, the gpt-oss format: per group of 32 inputs a power of two (biased by 127)
    that brings the group's largest magnitude to at most 6, then the nearest FP4 code of each
    value, two codes a byte, the even-indexed value in the low nibble."""
    e, out, width = w.shape
    groups = w.reshape(e, out, width // 32, 32).astype(np.float64)
    amax = np.abs(groups).max(-1)
    exponent = np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)).astype(np.int32)
    scaled = groups / np.exp2(exponent)[..., None]
    codes = np.abs(scaled[..., None] - FP4_VALUES.astype(np.float64)).argmin(-1).astype(np.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return np.ascontiguousarray(blocks, np.uint8), np.ascontiguousarray(exponent + 127, np.uint8)


def test_mxfp4_dequantization_is_exact():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    w = np.random.RandomState(0).standard_normal((3, 8, 64)).astype(np.float32) * np.array([1e-3, 1, 40])[:, None, None]
    blocks, scales = quantize_mxfp4(w)
    ours = dequantize_mxfp4(blocks, scales)  # [experts, in, out]
    theirs = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
    np.testing.assert_array_equal(ours, theirs.numpy())
    # FP4 values times powers of two are exact in bfloat16: straight to bfloat16 loses nothing.
    import ml_dtypes

    np.testing.assert_array_equal(dequantize_mxfp4(blocks, scales, ml_dtypes.bfloat16).astype(np.float32), ours)
    # And it is the quantization we meant: within half a code step of the weights.
    step = np.exp2(scales.astype(np.float64) - 127)[..., None].repeat(32, -1).reshape(w.shape)
    assert np.all(np.abs(np.swapaxes(ours, 1, 2) - w) <= step + 1e-12)
    with pytest.raises(ValueError, match="do not match"):
        dequantize_mxfp4(blocks, scales[..., :1])


def mxfp4_checkpoint(model, path: Path):
    """The model's expert projections replaced by their MXFP4 form (the module keeps the
    dequantized values, so it is the reference), written as the official files are."""
    from safetensors.numpy import load_file, save_file

    save_model(model, path)
    tensors = {k: np.array(v) for k, v in load_file(path / "model.safetensors").items()}  # copies, off the file
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = quantize_mxfp4(np.swapaxes(tensors.pop(name), 1, 2))
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        module_name = name.rsplit(".", 1)[0]
        param = model.get_submodule(module_name).get_parameter(name.rsplit(".", 1)[1])
        with torch.no_grad():
            param.copy_(torch.from_numpy(dequantize_mxfp4(blocks, scales)))
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["router", "lm_head"]}
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_mxfp4_checkpoint_loads_and_matches_transformers(tmp_path):
    model = make_model("gpt_oss", seed=3)
    path = mxfp4_checkpoint(model, tmp_path / "q")
    config, params = load_target(path, dequantize=True)  # kept in MXFP4: tests/test_mxfp4.py
    experts = params["model"]["layers_1"]["mlp"]["experts"]
    np.testing.assert_array_equal(np.asarray(experts["down_proj"]), model.model.layers[1].mlp.experts.down_proj.detach().numpy())
    out = forward(params, config, jnp.asarray(IDS, jnp.int32), init_cache(config, 2, 32))
    np.testing.assert_allclose(np.asarray(out.logits), torch_logits(model, IDS), atol=1e-4, rtol=0)

    # A scale missing from the checkpoint is named.
    from safetensors.numpy import load_file, save_file

    tensors = {k: np.array(v) for k, v in load_file(path / "model.safetensors").items()}
    del tensors["model.layers.2.mlp.experts.down_proj_scales"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model.layers.2.mlp.experts.down_proj.*blocks read"):
        load_target(path, dequantize=True)


# --------------------------------------------------------------------------- decoding


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_plain_greedy_decoding_equals_transformers_generate(family, hf_moe):
    assert_plain_greedy_equals_generate(*hf_moe[family])  # 19 tokens: longer than gpt-oss's window 8


# --------------------------------------------------------------------------- bad input

GOOD = dict(model_type="qwen3_moe", vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=4)


@pytest.mark.parametrize("change,message", [
    (dict(num_experts_per_tok=None), "missing required field 'num_experts_per_tok'"),
    (dict(num_experts=0), "'num_experts' must be a positive integer, got 0"),
    (dict(num_experts_per_tok=5), "num_experts_per_tok 5 > num_experts 4"),
    (dict(mlp_only_layers=[2]), r"mlp_only_layers \[2\] are not layers of a 2-layer model"),
    (dict(decoder_sparse_step=0), "'decoder_sparse_step' must be a positive integer"),
    (dict(moe_intermediate_size="wide"), "'moe_intermediate_size' must be a positive integer"),
    (dict(quantization_config={"quant_method": "awq"}), r"quantization 'awq' is not supported for qwen3_moe \(only fp8\)"),
    (dict(model_type="gpt_oss", num_experts=None, num_local_experts=None), "missing required field 'num_local_experts'"),
])
def test_bad_moe_config_is_a_one_line_error(change, message):
    cfg = {k: v for k, v in {**GOOD, **change}.items() if v is not None}
    with pytest.raises(ConfigError, match=message) as err:
        model_config(cfg)
    assert "\n" not in str(err.value)


def test_gpt_oss_accepts_mxfp4_and_qwen3_moe_hub_and_transformers_field_names():
    gpt = {**GOOD, "model_type": "gpt_oss", "num_local_experts": 4, "quantization_config": {"quant_method": "mxfp4"}}
    assert model_config(gpt).moe.num_experts == 4
    renamed = {**{k: v for k, v in GOOD.items() if k != "num_experts"}, "num_local_experts": 4}
    assert model_config(renamed).moe == model_config(GOOD).moe


# --------------------------------------------------------------------------- training


@pytest.mark.heavy
def test_train_cli_regenerates_with_and_trains_on_a_moe_target(hf_moe, tmp_path):
    """`python -m train` with a gpt-oss target: it regenerates responses with the target and
    trains a drafter against its taps; the drafter it exports pairs with that target."""
    losses = train_cli_on_regenerated(hf_moe["gpt_oss"][1], tmp_path, steps=6, save_every=3)
    assert len(losses) == 6 and all(np.isfinite(losses))


# --------------------------------------------------------------------------- with a drafter


def moe_drafter(target_dir: Path, out: Path) -> Path:
    """A random z-lab-format drafter for a MoE target, its first layer sliding (window 4)."""
    return write_random_drafter(target_dir, out, block_size=4, taps=(0, 3), layers=2, sliding_windows=(4, None))


def test_drafters_for_moe_targets_load_and_pair(hf_moe, tmp_path):
    from dflash_jax import load_drafter
    from dflash_jax.drafter import check_pair

    for family in MOE_FAMILIES:
        target = hf_moe[family][1]
        dcfg, _ = load_drafter(moe_drafter(target, tmp_path / family))
        assert dcfg.model.sliding_windows == (4, None) and dcfg.target_layer_ids == (0, 3)
        check_pair(load_target(target)[0], dcfg)


@pytest.mark.heavy
def test_infer_cli_with_a_moe_target_and_its_drafter_equals_plain_decoding(hf_moe, tmp_path):
    from infer.cli import main

    target = hf_moe["gpt_oss"][1]
    drafter = moe_drafter(target, tmp_path / "drafter")
    rs = np.random.RandomState(4)
    prompts = [rs.randint(0, 159, n).tolist() for n in (5, 14, 9)]
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"id": i, "input_ids": p}) + "\n" for i, p in enumerate(prompts)))
    out = tmp_path / "out.jsonl"
    assert main(["--target", str(target), "--drafter", str(drafter), "--input", str(inp), "--output", str(out),
                 "--max-new-tokens", "10", "--ignore-eos", "--quiet", "--batch-size", "2", "--speculation", "fixed"]) == 0
    rows = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    config, params = load_target(target)
    plain = BatchEngine(config, params, max_new_tokens=10, max_prompt_len=16, batch_size=1)
    for i, prompt in enumerate(prompts):
        assert rows[i]["output_ids"] == next(plain.generate([prompt])).output_ids, i


def test_a_drafter_made_for_a_moe_target_is_dense_and_its_config_round_trips(hf_moe):
    """`python -m train`'s new drafter for a gpt-oss target: Qwen3-style dense layers (no
    experts, sinks or float32 norm weights), the target's YaRN, and an exported config that
    reads back as the same drafter."""
    from dflash_jax.drafter import DrafterConfig
    from train.config import load_config, new_drafter_config

    tcfg = load_target(hf_moe["gpt_oss"][1])[0]
    cfg = load_config(REPO / "configs" / "train" / "tiny.yaml", [f"target={hf_moe['gpt_oss'][1]}"])
    drafter = new_drafter_config(cfg, tcfg, None, "float32")
    m = drafter.model
    assert m.moe is None and not m.sparse_layers and not m.attention_sinks and not m.norm_weight_in_float32
    assert m.rope == tcfg.rope and m.rope.type == "yarn" and not m.rope.truncate
    assert DrafterConfig.from_hf_dict(drafter.to_hf_dict()) == drafter
