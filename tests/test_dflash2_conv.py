"""DFlash2's dynamic convolution (`dflash_jax.dflash2.DynamicConv`) computed channel-wide: the
same numbers, bit for bit, as with the channels split into [groups, group_size] (the form it had,
which a TPU compile paid for with transposed copies of the drafter's o_proj and down_proj kernels),
and the formula of vLLM's grouped dynamic convolution."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.dflash2 import DynamicConv


def grouped(base, delta, y, block_size):
    """The convolution with y split into [G, group_size] channel groups (the earlier form)."""
    b, t, hidden = y.shape
    taps, groups = delta.shape[2], delta.shape[3]
    blocks = y.reshape(b, t, groups, hidden // groups)
    coeff = base.astype(y.dtype).reshape(1, 1, taps, groups, hidden // groups) + delta.astype(y.dtype)[..., None]
    place = jnp.arange(t) % block_size
    out = coeff[:, :, 0] * blocks
    for tap in range(1, taps):
        shifted = jnp.pad(blocks[:, :-tap], ((0, 0), (tap, 0), (0, 0), (0, 0)))
        out = out + coeff[:, :, tap] * jnp.where((place >= tap)[None, :, None, None], shifted, 0)
    return out.reshape(y.shape)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("hidden,taps,group,batch,length,block", [(256, 2, 16, 3, 16, 8), (384, 3, 8, 1, 24, 8),
                                                                   (512, 2, 64, 2, 32, 16)])
def test_channel_wide_convolution_is_the_grouped_one_bit_for_bit(dtype, hidden, taps, group, batch, length, block):
    k = jax.random.split(jax.random.PRNGKey(hidden + taps), 4)
    h, y = (jax.random.normal(k[i], (batch, length, hidden), dtype) for i in (0, 1))
    params = {"params": {"base_kernel": jax.random.normal(k[2], (2, taps, hidden), dtype),
                         "kernel_projection": {"kernel": 0.1 * jax.random.normal(k[3], (hidden, 2 * taps * hidden // group),
                                                                                   dtype)}}}
    conv = DynamicConv(hidden, taps, group, dtype)

    @jax.jit
    def both(p, h, y):
        prepared, delta1 = conv.apply(p, h, block, method=DynamicConv.prepare)
        finished = conv.apply(p, y, delta1, block, method=DynamicConv.finish)
        delta = conv.apply(p, h, method=lambda m, h: m.kernel_projection(h)).reshape(batch, length, 2, taps, -1)
        base = p["params"]["base_kernel"]
        return (prepared, finished), (grouped(base[0], delta[:, :, 0], h, block), grouped(base[1], delta[:, :, 1], y, block))

    (prepared, finished), (prepared_ref, finished_ref) = both(params, h, y)
    for got, want in ((prepared, prepared_ref), (finished, finished_ref)):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    # vLLM's formula, in float64: coeff[t, tap, c] = base[side, tap, c] + delta[t, side, tap, c // group]
    hf, df = np.asarray(h, np.float64), np.asarray(jnp.asarray(h, dtype) @ params["params"]["kernel_projection"]["kernel"],
                                                   np.float64).reshape(batch, length, 2, taps, -1)
    coeff = np.asarray(params["params"]["base_kernel"], np.float64)[0] + np.repeat(df[:, :, 0], group, axis=-1)
    want = sum(coeff[:, :, tap] * np.pad(hf, ((0, 0), (tap, 0), (0, 0)))[:, :length]
               * (np.arange(length) % block >= tap)[None, :, None] for tap in range(taps))
    np.testing.assert_allclose(np.asarray(prepared, np.float64), want, rtol=0.05 if dtype == jnp.bfloat16 else 1e-4,
                               atol=0.1 if dtype == jnp.bfloat16 else 1e-4)
