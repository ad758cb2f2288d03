"""The weight seam (`dflash_jax.model.weights`): the registry of formats, and the dense format's
products equal to the plain contractions (nn.Dense, jnp.dot, ragged_dot, einsum, Embed.attend) bit for bit."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.config import ModelConfig
from dflash_jax.errors import ConfigError
from dflash_jax.model import init_params
from dflash_jax.model.weights import (DENSE, FORMATS, Batched, Dot, Einsum, Grouped, Projection, Transposed, WeightFormat,
                                      as_weight, declare, project, weight_format)


def rand(seed, shape, dtype=jnp.float32):
    return jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32).astype(dtype)


def same(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))


def test_an_unknown_format_is_a_one_line_error_naming_the_known_ones():
    with pytest.raises(ConfigError) as e:
        weight_format("int3")
    assert str(e.value) == f"unknown weight format 'int3' (known: {', '.join(sorted(FORMATS))})"
    assert "dense" in FORMATS and weight_format("dense") is DENSE


def test_a_model_in_an_unknown_format_is_refused_with_that_error():
    config = ModelConfig(model_type="qwen3", vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=4, weight_format="int3")
    with pytest.raises(ConfigError) as e:
        jax.eval_shape(lambda: init_params(config))
    assert str(e.value) == f"unknown weight format 'int3' (known: {', '.join(sorted(FORMATS))})"


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("compute", ["param", "float32", None])
def test_a_dense_projection_is_nn_dense_bit_for_bit(dtype, bias, compute):
    """The same parameters (names, shapes, values from the same key) and the same outputs."""
    compute = {"param": dtype, "float32": jnp.float32, None: None}[compute]
    x = rand(1, (2, 5, 12), dtype)
    ours, theirs = (Projection(7, bias, compute, dtype), nn.Dense(7, use_bias=bias, dtype=compute, param_dtype=dtype))
    p_ours, p_theirs = ours.init(jax.random.PRNGKey(0), x), theirs.init(jax.random.PRNGKey(0), x)
    assert jax.tree.structure(p_ours) == jax.tree.structure(p_theirs)
    jax.tree.map(same, p_ours, p_theirs)
    if bias:  # a bias that is not zero, so the sum is tested
        p_ours = p_theirs = jax.tree.map(lambda a: a + 0.5, p_theirs)
    same(ours.apply(p_ours, x), theirs.apply(p_theirs, x))
    same(jax.jit(ours.apply)(p_ours, x), jax.jit(theirs.apply)(p_theirs, x))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_dense_products_are_the_plain_contractions(dtype):
    x, w = rand(1, (3, 4, 16), dtype), rand(2, (16, 6), dtype)
    same(project(x, as_weight(w)), jnp.dot(x, w))
    same(project(x, as_weight(w), Dot(jnp.float32)), jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32)))
    table = rand(3, (10, 16), dtype)  # a tied head: x . table^T, as nn.Embed.attend
    embed = nn.Embed(10, 16, dtype=dtype, param_dtype=dtype)
    same(project(x, as_weight(table), Transposed(dtype)),
         embed.apply({"params": {"embedding": table}}, x, method=nn.Embed.attend))
    rows, experts = rand(4, (9, 16), dtype), rand(5, (3, 16, 6), dtype)
    sizes = jnp.asarray([4, 0, 5], jnp.int32)
    same(project(rows, as_weight(experts), Grouped(sizes, dtype)),
         jax.lax.ragged_dot(rows, experts, sizes, preferred_element_type=jnp.float32).astype(dtype))
    kv_b = rand(6, (2 * 5, 16), dtype)  # MLA's fold: each head's first 3 rows of kv_b_proj
    view = lambda w: w.reshape(2, 5, 16)[:, :3]  # noqa: E731
    q = rand(7, (1, 4, 2, 3), dtype)
    same(project(q, as_weight(kv_b), Einsum("bthn,hnl->bthl", dtype, view)),
         jnp.einsum("bthn,hnl->bthl", q, view(kv_b), preferred_element_type=jnp.float32).astype(dtype))


def test_a_registered_format_stores_its_own_parameters_and_runs_through_the_seam(monkeypatch):
    """A format of a kernel and a per-column scale, registered for this test: a projection in it
    stores `kernel` and `kernel_scale` beside each other and computes x . (kernel * scale)."""
    scaled = WeightFormat(
        "scaled",
        stored=lambda shape, dtype, init: {"": (shape, dtype, init),
                                           "_scale": (shape[-1:], jnp.float32, nn.initializers.ones)},
        materialize=lambda a, dtype: (a[""].astype(jnp.float32) * a["_scale"]).astype(dtype))
    monkeypatch.setitem(FORMATS, "scaled", scaled)
    assert weight_format("scaled").suffixes == ("_scale",)
    x = rand(1, (2, 8))
    params = Projection(4, format="scaled").init(jax.random.PRNGKey(0), x)["params"]
    assert {k: v.shape for k, v in params.items()} == {"kernel": (8, 4), "kernel_scale": (4,)}
    params = {**params, "kernel_scale": jnp.asarray([1.0, 2.0, 0.5, -1.0])}
    got = Projection(4, format="scaled").apply({"params": params}, x)
    np.testing.assert_allclose(got, x @ (params["kernel"] * params["kernel_scale"]), rtol=1e-6)

    class Holder(nn.Module):  # a bare weight (as the experts' stacks, MLA's kv_b_proj) in the format
        @nn.compact
        def __call__(self):
            return declare(self, "w", (3, 8, 4), jnp.float32, nn.initializers.ones, "scaled")

    stored = Holder().init(jax.random.PRNGKey(0))["params"]
    assert {k: v.shape for k, v in stored.items()} == {"w": (3, 8, 4), "w_scale": (4,)}


def test_format_rules_pick_a_format_per_weight_by_its_path_the_first_match_winning(monkeypatch):
    """`FormatRules`: exact paths and globs, in order; a path no rule names is dense; a model's
    projections each take the format of their own path (the scale appears only where the rule says)."""
    from dflash_jax.model.weights import format_for, formats_in

    rules = (("layers_0/mlp/down_proj/kernel", "dense"), ("layers_*/mlp/*", "scaled"), ("lm_head/kernel", "int3"))
    assert format_for(rules, "layers_0/mlp/down_proj/kernel") == "dense"
    assert format_for(rules, "layers_0/mlp/up_proj/kernel") == "scaled"
    assert format_for(rules, "layers_12/mlp/experts/gate_proj") == "scaled"
    assert format_for(rules, "layers_1/self_attn/q_proj/kernel") == "dense"
    assert format_for(rules, "lm_head/kernel") == "int3"
    assert format_for("scaled", "anything") == "scaled"
    assert formats_in(rules) == ("dense", "scaled", "int3") and formats_in("dense") == ("dense",)
    later = (("layers_*/mlp/*", "scaled"), ("layers_0/mlp/down_proj/kernel", "dense"))  # the glob comes first
    assert format_for(later, "layers_0/mlp/down_proj/kernel") == "scaled"

    scaled = WeightFormat(
        "scaled",
        stored=lambda shape, dtype, init: {"": (shape, dtype, init),
                                           "_scale": (shape[-1:], jnp.float32, nn.initializers.ones)},
        materialize=lambda a, dtype: (a[""].astype(jnp.float32) * a["_scale"]).astype(dtype))
    monkeypatch.setitem(FORMATS, "scaled", scaled)
    config = ModelConfig(model_type="qwen3", vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                         weight_format=(("model/layers_1/mlp/*", "scaled"),))
    flat = jax.tree_util.tree_flatten_with_path(jax.eval_shape(lambda: init_params(config)))[0]
    scales = sorted("/".join(k.key for k in path) for path, _ in flat if "_scale" in path[-1].key)
    assert scales == [f"model/layers_1/mlp/{p}/kernel_scale" for p in ("down_proj", "gate_proj", "up_proj")], scales


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_taken_weights_in_a_batched_product_are_each_experts_own_product(dtype):
    """`Weight.take` picks experts of a stack (still in its format); `Batched` multiplies each by its rows."""
    stack, x = rand(1, (5, 16, 6), dtype), rand(2, (3, 4, 16), dtype)
    picked = as_weight(stack).take(jnp.asarray([4, 0, 4]))
    assert picked.dense.shape == (3, 16, 6) and picked.format is DENSE
    got = project(x, picked, Batched(dtype))
    for k, e in enumerate([4, 0, 4]):
        same(got[k], jnp.dot(x[k], stack[e], preferred_element_type=jnp.float32).astype(dtype))
