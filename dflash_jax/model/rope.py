"""RoPE frequencies with Hugging Face's scaling rules (default, linear, Llama 3, YaRN,
proportional), for a `RopeConfig`."""

from __future__ import annotations

import math

from dflash_jax.config import RopeConfig


def rope_inv_freq(rope: RopeConfig, head_dim: int):
    """Inverse frequencies [rotary_dim // 2], float32, with HF's scaling rules."""
    import numpy as np

    if rope.type != "proportional":
        head_dim = rope.rotary_dim(head_dim)

    # float32 like transformers, so positions far out agree to the last bit we can.
    exponent = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    inv = (np.float32(1.0) / (np.float32(rope.theta) ** exponent)).astype(np.float64)
    if rope.type == "linear":
        inv = inv / rope.factor
    elif rope.type == "llama3":
        low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
        high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = np.where(medium, smoothed, scaled)
    elif rope.type == "yarn":
        return _yarn_inv_freq(rope, head_dim)
    elif rope.type == "proportional":
        rotated = int(rope.partial_rotary_factor * head_dim // 2)
        exponent = np.arange(0, 2 * rotated, 2, dtype=np.float32) / np.float32(head_dim)
        inv = np.float32(1.0) / (np.float32(rope.theta) ** exponent)
        inv = np.concatenate([inv, np.zeros(head_dim // 2 - rotated, np.float32)]) / np.float32(rope.factor)
    return inv.astype(np.float32)


def _yarn_inv_freq(rope: RopeConfig, dim: int):
    """YaRN (arXiv 2309.00071) as transformers computes it, in float32: interpolated
    frequencies (divided by `factor`) for the long wavelengths, the original ones for the
    short, and a linear ramp between the dimensions `beta_fast` and `beta_slow` rotations
    mark over the original context."""
    import numpy as np

    def correction_dim(rotations):
        return dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = np.float32(rope.theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    extrapolation = np.float32(1.0) / pos_freqs
    interpolation = np.float32(1.0) / (np.float32(rope.factor) * pos_freqs)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolation_weight = np.float32(1) - ramp.astype(np.float32)
    inv = interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight
    return inv.astype(np.float32)
