"""What the tests share.

- The reference outputs of the PyTorch implementation: tests/reference/ in the repository (outputs of
  z-lab's reference implementation for a tiny pair, 1.6 MB), or the directory $DFLASH_FIXTURES names
  (`tiny`, `TINY`).
- Tiny random target/drafter pairs of every family the engine decodes (`SETUPS`, `setup`,
  `model_config`, `drafter_config`), their prompts and the engines built over them (`engine`: shared,
  built once per static shape, since compiling is the cost), and the shapes those engines use.
- The sampling references: a small-vocabulary pair (`sampling_setup`), the exact distribution of its
  first tokens from an independent numpy implementation (`exact_joint`), the engine's samples of them
  (`speculative_samples`) and the total-variation bound a lossless sampler stays within (`tv_bound`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import ModelConfig, forward, init_cache
from dflash_jax.config import LinearAttentionConfig, MoeConfig, RopeConfig
from dflash_jax.drafter import DrafterConfig, init_drafter_params
from dflash_jax.engine import BatchEngine, Sampling, greedy_pick, processed_logits
from dflash_jax.model import init_params


ROOT = Path(os.environ.get("DFLASH_FIXTURES", Path(__file__).resolve().parent / "reference"))
TINY = ROOT / "tiny-qwen3-dflash"


def tiny() -> Path:
    if not (TINY / "expected.npz").is_file():
        raise FileNotFoundError(f"parity fixtures not found at {TINY} (tests/reference/ is part of the repository; "
                                f"is $DFLASH_FIXTURES set to another directory?)")
    return TINY


# --------------------------------------------------------------------------- tiny pairs and their engines


# Mixture-of-experts targets (3 layers): Qwen3-MoE with a dense middle layer; gpt-oss with
# sliding (window 6, shorter than most prompts) and full layers, sinks, YaRN and biases.
HYBRID = dict(linear_attention=LinearAttentionConfig(k_heads=2, v_heads=4, k_dim=8, v_dim=8),
              linear_layers=(True, False, True), attention_output_gate=True, norm_zero_centered=True,
              rope=RopeConfig(partial_rotary_factor=0.5))
SWITCHES = {
    "qwen3_moe": dict(moe=MoeConfig(num_experts=4, top_k=2, intermediate_size=16, norm_topk_prob=True),
                      sparse_layers=(True, False, True)),
    "gpt_oss": dict(qkv_bias=True, o_bias=True, attention_sinks=True, norm_weight_in_float32=True,
                    sliding_windows=(6, None, 6), sparse_layers=(True, True, True),
                    rope=RopeConfig(theta=150000.0, type="yarn", factor=8.0, original_max_position_embeddings=32,
                                    truncate=False, attention_factor=1.2079),
                    moe=MoeConfig(num_experts=4, top_k=2, intermediate_size=16, router="topk_softmax",
                                  router_bias=True, expert_bias=True, fused_gate_up=True, activation="clamped_swiglu")),
    # Hybrid (Qwen3.5): gated delta-net layers around a gated full-attention layer, partial
    # RoPE, (1 + w) norms; its MoE variant adds a shared expert. The verify pass defers the
    # linear layers' states, which commit settles at each row's accepted prefix.
    # Gemma 4: sliding (window 6) and a global layer of its own head shape (16 x 1 KV head,
    # k = v, proportional RoPE), the last layer reading the first's K/V, per-layer inputs,
    # experts beside the MLP, sandwich norms, soft-capped logits.
    "gemma4": dict(global_head_dim=16, global_kv_heads=1, attention_k_eq_v=True, kv_shared_from=(None, None, 0),
                   global_rope=RopeConfig(theta=1e6, type="proportional", partial_rotary_factor=0.25),
                   sliding_windows=(6, None, 6), value_norm=True, attention_scale=1.0, block_norms="sandwich",
                   embed_scale=True, final_logit_softcap=30.0, mlp_activation="gelu_tanh", layer_scalar=True,
                   norm_weight_in_float32=True, per_layer_input_size=4, sparse_layers=(True, True, True),
                   moe=MoeConfig(num_experts=4, top_k=2, intermediate_size=16, norm_topk_prob=True,
                                 gate_up_halves=True, router_input_norm=True, per_expert_scale=True,
                                 activation="gelu_tanh")),
    "qwen3_5": dict(HYBRID),
    "qwen3_5_moe": dict(HYBRID, sparse_layers=(True, True, True),
                        moe=MoeConfig(num_experts=4, top_k=2, intermediate_size=16, norm_topk_prob=True,
                                      shared_expert_size=24)),
}


QK_NORM = ("qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe", "gemma4")


def model_config(family: str, vocab: int, layers: int) -> ModelConfig:
    per_layer_vocab = {"per_layer_vocab_size": vocab} if family == "gemma4" else {}
    return ModelConfig(
        model_type=family, vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, qk_norm=family in QK_NORM,
        **SWITCHES.get(family, {}), **per_layer_vocab,
    )


def drafter_config(target: ModelConfig, layers: int, taps: tuple[int, ...], block_size: int = 8) -> DrafterConfig:
    return DrafterConfig(
        model=model_config("qwen3", target.vocab_size, layers), block_size=block_size,
        mask_token_id=target.vocab_size - 1, target_layer_ids=taps, num_target_layers=target.num_hidden_layers,
    )


# name: (family, vocab, target layers, drafter layers, taps, seed)
SETUPS = {
    "qwen3-v8": ("qwen3", 8, 3, 2, (0, 2), 1),
    "llama-v8": ("llama", 8, 2, 1, (1,), 2),
    "qwen3-v128": ("qwen3", 128, 3, 2, (0, 2), 3),
    "llama-v128": ("llama", 128, 2, 1, (1,), 4),
    "qwen3_moe-v8": ("qwen3_moe", 8, 3, 2, (0, 2), 5),
    "gpt_oss-v8": ("gpt_oss", 8, 3, 2, (0, 2), 9),  # its drafter's first layer slides (window 6)
    "gemma4-v8": ("gemma4", 8, 3, 2, (0, 2), 15),
    "qwen3_5-v8": ("qwen3_5", 8, 3, 2, (0, 2), 13),
    "qwen3_5_moe-v8": ("qwen3_5_moe", 8, 3, 2, (0, 2), 14),
}


MAX_NEW = 24
MAX_PROMPT = 32
# Two prompt buckets (16 and 32: two prefill chunks of 16, several pages), so an engine compiles few
# prefill programs.
PROMPT_LENGTHS = (5, 32, 1, 17, 3, 13, 30, 2, 8, 21, 16, 29)
SLOTS = 3  # the batch of the everyday engines (admission widths 1, 2, 3), shared between tests


@functools.cache
def setup(name):
    family, vocab, layers, dlayers, taps, seed = SETUPS[name]
    target = model_config(family, vocab, layers)
    drafter = drafter_config(target, dlayers, taps)
    if family == "gpt_oss":
        drafter = dataclasses.replace(drafter, model=drafter.model.replace(sliding_windows=(6, None)))
    return (target, perturbed(init_params(target, jax.random.PRNGKey(seed))),
            drafter, init_drafter_params(drafter, jax.random.PRNGKey(seed + 100)))


def perturbed(params):
    """Random init leaves biases and sinks at 0 and experts at std 0.02: move them so every
    switch matters."""
    def one(path, p):
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        if name.endswith(("bias", "sinks")):
            return p + 0.3 * jax.random.normal(jax.random.PRNGKey(len(name)), p.shape, p.dtype)
        return p * 10 if "/experts/" in name else p
    return jax.tree_util.tree_map_with_path(one, params)


@functools.cache
def prompts(name):
    vocab, seed = SETUPS[name][1], SETUPS[name][5]
    rs = np.random.RandomState(seed)
    return tuple(tuple(rs.randint(0, vocab, n).tolist()) for n in PROMPT_LENGTHS)


PAGE = 16  # small pages: a row's context spans several, so the page walk is exercised
CHUNK = 16  # and prompts longer than 16 tokens prefill in chunks


@functools.cache
def engine(name, block_size, batch_size, *, max_new=MAX_NEW, stop=(), sampling=Sampling(), max_prompt=MAX_PROMPT):
    target, tparams, drafter, dparams = setup(name)
    return BatchEngine(target, tparams, drafter if block_size > 1 else None, dparams if block_size > 1 else None,
                     block_size=block_size, batch_size=batch_size, max_new_tokens=max_new,
                     max_prompt_len=max_prompt, sampling=sampling, stop_token_ids=stop, page_size=PAGE,
                     prefill_chunk=CHUNK, speculation="fixed")


def by_index(results):
    out = {r.index: r for r in results}
    return [out[i] for i in sorted(out)]


def check_lengths(results, block_size, max_new):
    """Rows that finish by length hold exactly max_new tokens, and the cycle loop ran just
    long enough: the reference keeps cycling while generated <= max_new."""
    for r in results:
        acc = r.acceptance_lengths
        assert all(1 <= a <= block_size for a in acc), acc
        if r.finish_reason == "length":
            assert len(r.output_ids) == max_new
            assert 1 + sum(acc) >= max_new + 1
            assert 1 + sum(acc[:-1]) <= max_new  # the last cycle was still needed
        else:  # the stop token came from the prefill (no cycle) or from the last cycle
            assert r.finish_reason == "stop"
            generated = 1 + sum(acc)
            assert (not acc and len(r.output_ids) == 1) or 1 + sum(acc[:-1]) < len(r.output_ids) <= generated


heavy = lambda *args: pytest.param(*args, marks=pytest.mark.heavy)  # the full matrix: `-m heavy`


GREEDY_CASES = [  # everyday: a dense (Qwen3) and a hybrid (Qwen3.5) pair; `-m heavy` the rest (Llama and Qwen3-MoE
    # decode plainly as transformers' `generate` everyday, in test_moe.py; gpt-oss's and Gemma 4's chains are heavy,
    # their trees everyday: test_tree)
    # Every family at one block size; the block sizes (2, 4, 8) and batches (1, 3, 5, 8, the slots) swept on
    # qwen3 and once more each on a hybrid, llama, gpt-oss and gemma4 (cases that crossed the same two again
    # went for .ci/run's 50 minutes).
    # 2026-12-07, for the same budget: the second hybrid, Gemma 4 and gpt-oss sweeps and three more Qwen3
    # ones went (block 2 stays on qwen3, batch 1 on qwen3 at block 4, batch 5 on qwen3_5_moe, batch 8 on
    # llama and qwen3 at block 2, the 128-token vocabulary on llama).
    ("qwen3-v8", 8, SLOTS), heavy("llama-v8", 8, SLOTS), heavy("qwen3_moe-v8", 4, SLOTS), heavy("gpt_oss-v8", 8, SLOTS),
    ("qwen3_5-v8", 4, SLOTS), heavy("gemma4-v8", 8, SLOTS), heavy("qwen3_5_moe-v8", 4, 5), heavy("llama-v8", 8, 8),
    heavy("qwen3-v8", 2, 8), heavy("qwen3-v8", 4, 1), heavy("llama-v128", 8, 3),
]


LIMITS = (24, 5, 17, 1, 24, 9, 13, 24, 2, 20, 11, 24)  # per-row max_new_tokens for the 12 prompts


# --------------------------------------------------------------------------- sampling references


NEG = float(jnp.finfo(jnp.float32).min)


def target_distribution(logits, sampling: Sampling):
    """The exact distribution the engine's target samples from, [..., vocab] float32: one-hot on
    its greedy pick, else the softmax of its processed logits (temperature, top-k, top-p)."""
    if sampling.greedy:
        return jax.nn.one_hot(greedy_pick(logits), logits.shape[-1], dtype=jnp.float32)
    return jax.nn.softmax(processed_logits(logits, sampling), axis=-1)


def numpy_top_p(logits, p):
    """Keep the smallest prefix of the descending probabilities whose mass reaches p.
    logits [N, vocab] -> (keep [N, vocab], distance of the nearest prefix mass to p)."""
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    order = np.argsort(-probs, axis=-1)
    cum = np.cumsum(np.take_along_axis(probs, order, -1), -1)
    n_keep = (cum < p).sum(-1) + 1  # the first prefix whose mass is >= p
    keep = np.zeros(probs.shape, bool)
    for row in range(probs.shape[0]):
        keep[row, order[row, :n_keep[row]]] = True
    return keep, np.abs(cum - p).min()


def numpy_distribution(logits, sampling):
    """What the target samples from, in float64: temperature, then top-k, then top-p over
    the renormalised survivors. Returns (probabilities, top-p margin: the answer is only
    unambiguous when no prefix mass is within rounding of p)."""
    z = np.asarray(logits, np.float64) / sampling.temperature
    shape = z.shape
    z = z.reshape(-1, shape[-1])
    if 0 < sampling.top_k < shape[-1]:  # k >= vocab keeps every token, as in HF
        kth = -np.sort(-z, -1)[:, sampling.top_k - 1:sampling.top_k]
        z = np.where(z < kth, -np.inf, z)
    margin = np.inf
    if sampling.top_p < 1:
        keep, margin = numpy_top_p(z, sampling.top_p)
        z = np.where(keep, z, -np.inf)
    probs = np.exp(z - z.max(-1, keepdims=True))
    return (probs / probs.sum(-1, keepdims=True)).reshape(shape), margin


V = 12
SAMPLE_PROMPT = (3, 1, 4, 1, 5)
N_SAMPLES = 4096
SAMPLE_BATCH = 512
SAMPLINGS = [Sampling(temperature=1.0), Sampling(temperature=0.7, top_k=5), Sampling(temperature=1.0, top_p=0.8)]


@functools.cache
def sampling_setup(family="qwen3"):
    """A small-vocabulary target with its head scaled x2, so its distributions are peaked and
    depend on the context (a broken rule then shifts them measurably), and a drafter whose
    first draft the target samples about 35-45% of the time."""
    target = model_config(family, V, 2)
    if target.moe is not None:
        target = target.replace(sparse_layers=(True, True), sliding_windows=target.sliding_windows[:2])
    if target.linear_layers:
        target = target.replace(linear_layers=(True, False))
    if target.kv_shared_from:  # two layers of different kinds: nothing to share
        target = target.replace(kv_shared_from=())
    tparams = init_params(target, jax.random.PRNGKey(2))
    tparams = {**tparams, "lm_head": {"kernel": 2.0 * tparams["lm_head"]["kernel"]}}
    drafter = drafter_config(target, 1, (0, 1), block_size=4)
    # First-draft acceptance ~35% (qwen3), ~30% (gpt-oss; 52 gives 13%), ~33% (qwen3_5), ~24% (gemma4).
    key = {"qwen3": 52, "gpt_oss": 60, "qwen3_5": 79, "gemma4": 44}[family]
    return target, tparams, drafter, init_drafter_params(drafter, jax.random.PRNGKey(key))


@functools.cache
def exact_logits(family="qwen3"):
    """Target logits for every continuation (t1, t2) of the prompt: [V, V, P + 2, V]."""
    target, tparams, _, _ = sampling_setup(family)
    p = len(SAMPLE_PROMPT)
    t1, t2 = np.meshgrid(np.arange(V), np.arange(V), indexing="ij")
    tokens = np.concatenate([np.tile(SAMPLE_PROMPT, (V * V, 1)), t1.reshape(-1, 1), t2.reshape(-1, 1)], 1)
    out = forward(tparams, target, jnp.asarray(tokens, jnp.int32), init_cache(target, V * V, p + 2))
    return np.asarray(out.logits).reshape(V, V, p + 2, V)


def exact_distribution(logits, sampling):
    """The target's sampling distribution from an independent numpy implementation, after
    checking that `target_distribution` (the engine's own pieces) agrees with it."""
    probs, margin = numpy_distribution(logits, sampling)
    assert margin > 1e-5
    np.testing.assert_allclose(np.asarray(target_distribution(jnp.asarray(logits), sampling)), probs, atol=1e-5)
    return probs


def exact_joint(sampling, family="qwen3"):
    """p(t1, t2, t3) of plain autoregressive sampling from the target, [V, V, V]."""
    logits = exact_logits(family)
    p = len(SAMPLE_PROMPT)
    p1 = exact_distribution(logits[0, 0, p - 1], sampling)  # [t1]
    p2 = exact_distribution(logits[:, 0, p], sampling)  # [t1, t2]
    p3 = exact_distribution(logits[:, :, p + 1], sampling)  # [t1, t2, t3]
    return p1[:, None, None] * p2[:, :, None] * p3


def tv_bound(p, n, delta=1e-6):
    """With probability >= 1 - delta, the empirical distribution of n iid samples of p is
    within this total variation of p: E[TV] <= 1/2 sum_i sqrt(p_i (1 - p_i) / n) (Jensen),
    and TV moves by at most 1/n when one sample changes, so McDiarmid adds
    sqrt(ln(1/delta) / (2n)). Here (n = 4096, 144 cells, peaked p) it is about 0.1."""
    return 0.5 * np.sum(np.sqrt(p * (1 - p) / n)) + math.sqrt(math.log(1 / delta) / (2 * n))


def tv(p, q):
    return 0.5 * np.abs(p - q).sum()


@functools.cache
def speculative_samples(sampling, family="qwen3", tree_budget=0):
    """The first three tokens of N_SAMPLES rows (row ids key the random streams) and each
    row's first acceptance length, from the block-4 engine (verifying a draft tree of
    tree_budget nodes, where given). Three, not two: token 1 comes
    from the prefill and token 2 is always y_0, the target's own sample in the first verify
    pass, whatever was accepted; token 3 is the first one the acceptance rule decides."""
    target, tparams, drafter, dparams = sampling_setup(family)
    gen = BatchEngine(target, tparams, drafter, dparams, block_size=4, batch_size=SAMPLE_BATCH, max_new_tokens=3,
                    max_prompt_len=16, sampling=sampling, tree_budget=tree_budget, speculation="fixed")
    results = by_index(gen.generate([list(SAMPLE_PROMPT)] * N_SAMPLES, seed=1234, indices=range(N_SAMPLES)))
    assert all(len(r.output_ids) == 3 and r.finish_reason == "length" for r in results)
    return np.array([r.output_ids for r in results]), np.array([r.acceptance_lengths[0] for r in results])
