"""The static KV cache with a length per row: prefill, decode, per-row offsets, rollback."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import ConfigError, ModelConfig, forward, init_cache
from dflash_jax.model import init_params

CONFIG = ModelConfig(
    model_type="qwen3", vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, qk_norm=True,
    sliding_windows=(None, 5, None),  # one windowed layer, so windows are exercised too
)
PARAMS = init_params(CONFIG, jax.random.PRNGKey(3))
TAPS = (0, 2)
TOL = dict(atol=2e-5, rtol=0)


def run(tokens, cache, **kw):
    return forward(PARAMS, CONFIG, jnp.asarray(tokens, jnp.int32), cache, taps=TAPS, **kw)


def full(seq):
    """Logits and taps of one sequence processed in a single call."""
    out = run(np.asarray(seq)[None], init_cache(CONFIG, 1, 32))
    return np.asarray(out.logits[0]), np.asarray(out.tap_features[0])


def ids(n, seed):
    return np.random.RandomState(seed).randint(0, CONFIG.vocab_size, n)


def test_prefill_then_token_by_token_decode_equals_full_forward():
    seq = ids(14, 0)
    ref_logits, ref_taps = full(seq)
    out = run(seq[None, :6], init_cache(CONFIG, 1, 32))
    logits, taps = [np.asarray(out.logits[0])], [np.asarray(out.tap_features[0])]
    cache = out.cache
    for t in range(6, 14):
        out = run(seq[None, t:t + 1], cache)
        cache = out.cache
        logits.append(np.asarray(out.logits[0]))
        taps.append(np.asarray(out.tap_features[0]))
    assert int(cache.lengths[0]) == 14
    np.testing.assert_allclose(np.concatenate(logits), ref_logits, **TOL)
    np.testing.assert_allclose(np.concatenate(taps), ref_taps, **TOL)


def test_chunk_at_per_row_offsets_equals_per_row_runs():
    a, b = ids(12, 1), ids(12, 2)
    # Row 0 has 4 tokens cached, row 1 has 7; both then take a chunk of 5 at their own offset.
    cache = init_cache(CONFIG, 2, 32)
    prompt = np.zeros((2, 7), np.int64)
    prompt[0, :4], prompt[1, :7] = a[:4], b[:7]
    cache = run(prompt, cache, num_tokens=jnp.array([4, 7])).cache
    np.testing.assert_array_equal(np.asarray(cache.lengths), [4, 7])
    chunk = np.stack([a[4:9], b[7:12]])
    out = run(chunk, cache)
    np.testing.assert_array_equal(np.asarray(out.cache.lengths), [9, 12])
    for row, seq, start in ((0, a, 4), (1, b, 7)):
        ref_logits, ref_taps = full(seq[:start + 5])
        np.testing.assert_allclose(np.asarray(out.logits[row]), ref_logits[start:], **TOL)
        np.testing.assert_allclose(np.asarray(out.tap_features[row]), ref_taps[start:], **TOL)


@pytest.mark.parametrize("bucket", [12, 16])
def test_padded_batch_of_different_prompt_lengths_equals_each_alone(bucket):
    lengths = [3, 12, 7, 1]
    seqs = [ids(n + 4, 10 + i) for i, n in enumerate(lengths)]
    tokens = np.zeros((4, bucket), np.int64)
    for i, n in enumerate(lengths):
        tokens[i, :n] = seqs[i][:n]
    last = jnp.array(lengths)[:, None] - 1
    out = run(tokens, init_cache(CONFIG, 4, 32), num_tokens=jnp.array(lengths), logits_indices=last)
    assert out.logits.shape == (4, 1, CONFIG.vocab_size)
    cache = out.cache
    # Then four decode steps for the whole batch: padding written past each row's length
    # is stale and must never be read.
    steps = [np.asarray(out.logits[:, 0])]
    for t in range(4):
        step_tokens = np.array([[s[n + t]] for s, n in zip(seqs, lengths)])
        out = run(step_tokens, cache)
        cache = out.cache
        steps.append(np.asarray(out.logits[:, 0]))
    for i, n in enumerate(lengths):
        ref_logits, _ = full(seqs[i][:n + 4])
        np.testing.assert_allclose(np.stack([s[i] for s in steps]), ref_logits[n - 1:n + 4], **TOL)


def test_rollback_is_a_length_update():
    seq, wrong = ids(10, 5), ids(4, 6)
    cache = run(seq[None, :6], init_cache(CONFIG, 1, 32)).cache
    # A verify-like pass writes 4 tokens, then all but one are rejected.
    cache = run(wrong[None], cache).cache
    cache = cache.replace(lengths=cache.lengths - 3)
    assert int(cache.lengths[0]) == 7
    # Continue with different tokens; the rejected entries at 7..9 are overwritten or masked.
    true_seq = np.concatenate([seq[:6], wrong[:1], seq[6:9]])
    out = run(true_seq[None, 7:], cache)
    ref_logits, ref_taps = full(true_seq)
    np.testing.assert_allclose(np.asarray(out.logits[0]), ref_logits[7:], **TOL)
    # And a stale entry past the length (rejected token at 9) is not read by a short chunk.
    cache = run(seq[None, :6], init_cache(CONFIG, 1, 32)).cache
    cache = run(wrong[None], cache).cache.replace(lengths=jnp.array([6]))
    out = run(seq[None, 6:7], cache)
    np.testing.assert_allclose(np.asarray(out.logits[0]), full(seq[:7])[0][6:], **TOL)


def test_bad_tap_is_refused():
    with pytest.raises(ConfigError, match="outside the target's 3 layers"):
        forward(PARAMS, CONFIG, jnp.zeros((1, 2), jnp.int32), init_cache(CONFIG, 1, 8), taps=(3,))
