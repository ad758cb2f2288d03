"""The pairs a benchmark runs: a target + drafter from directories (default the bundled demo
pair), a random tiny pair built in memory (--random), and the description of a published shape
(`dflash_jax.shapes`: Qwen3-8B + 5-layer block-16 drafter and others, scaled), whose weights are
random or only abstract."""

from __future__ import annotations

import dataclasses
import functools
import time
from pathlib import Path


@dataclasses.dataclass
class Pair:
    name: str
    target: object  # ModelConfig
    tparams: object
    drafter: object  # DrafterConfig
    dparams: object
    tokenizer: object = None
    target_dir: Path | None = None
    drafter_dir: Path | None = None
    demo: bool = False
    random: bool = False
    load_seconds: float = 0.0


def directory_pair(target_dir: Path | None, drafter_dir: Path | None, dtype: str | None) -> Pair:
    """The pair in these directories (HF or converted), with the target's tokenizer when it has
    one, on one device (`dflash_jax.pair.load_pair`); both None: the bundled demo pair. Raises
    DFlashError."""
    from dflash_jax.pair import load_pair

    if (target_dir is None) != (drafter_dir is None):
        raise SystemExit("error: --target and --drafter go together")
    pair = load_pair(target_dir, drafter_dir, dtype=dtype)
    name = "bundled demo pair" if pair.demo else f"{pair.target_dir.name} + {pair.drafter_dir.name}"
    return Pair(name, pair.target, pair.tparams, pair.drafter, pair.dparams, pair.tokenizer, pair.target_dir,
                pair.drafter_dir, pair.demo, load_seconds=pair.load_seconds)


def random_configs(hidden: int = 128, layers: int = 6, heads: int = 4, vocab: int = 1024, drafter_layers: int = 2,
                   block_size: int = 8, dtype: str = "float32"):
    """A tiny Qwen3 target (KV heads: half the heads) and a drafter of its shape."""
    from dflash_jax.config import ModelConfig
    from dflash_jax.drafter import DrafterConfig, default_target_layer_ids

    if hidden % heads:
        raise SystemExit(f"error: --hidden {hidden} is not divisible by --heads {heads}")
    target = ModelConfig(
        model_type="qwen3", vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
        head_dim=hidden // heads, max_position_embeddings=4096, qk_norm=True, sliding_windows=(None,) * layers,
        dtype=dtype,
    )
    drafter = DrafterConfig(
        model=target.replace(num_hidden_layers=drafter_layers, sliding_windows=(None,) * drafter_layers),
        block_size=block_size, mask_token_id=vocab - 1,
        target_layer_ids=default_target_layer_ids(layers, drafter_layers), num_target_layers=layers,
    )
    return target, drafter


def random_pair(args) -> Pair:
    """--random: a random tiny Qwen3 target and a random drafter, in memory (tau near 1: the
    figures measure the engine, not a drafter)."""
    import jax

    from dflash_jax.drafter import init_drafter_params
    from dflash_jax.model import init_params

    t = time.perf_counter()
    target, drafter = random_configs(args.hidden, args.layers, args.heads, args.vocab, args.drafter_layers,
                                     args.random_block_size, args.dtype or "float32")
    tparams = init_params(target, jax.random.PRNGKey(args.seed))
    dparams = init_drafter_params(drafter, jax.random.PRNGKey(args.seed + 1))
    name = (f"random qwen3 (hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}) + random "
            f"{args.drafter_layers}-layer drafter")
    return Pair(name, target, tparams, drafter, dparams, random=True, load_seconds=time.perf_counter() - t)


def describe_published(target, drafter, scale: float, dtype: str) -> str:
    t, d = target, drafter.model
    hybrid = f" ({t.num_linear_layers} gated delta-net)" if t.num_linear_layers else ""
    return (f"published shapes x {scale:g}: target {t.model_type} hidden {t.hidden_size}, {t.num_hidden_layers} "
            f"layers{hybrid}, {t.num_attention_heads}/{t.num_key_value_heads} heads x {t.head_dim}, intermediate "
            f"{t.intermediate_size}, vocab {t.vocab_size}; drafter {d.num_hidden_layers} layers, block "
            f"{drafter.block_size}, taps {list(drafter.target_layer_ids)}{_dflash2(drafter)}; {dtype}")


def _dflash2(drafter) -> str:
    d2 = drafter.dflash2
    return "" if d2 is None else (f", DFlash2 (convolutions of {d2.conv_kernel_size} taps over groups of "
                                  f"{d2.conv_group_size}, selector rank {d2.selector_rank}, top-{d2.selector_top_k})")


def random_params(abstract, seed: int):
    """Random parameters with the shapes/dtypes of `abstract`: normal * 0.02, norms 1. One small
    jitted generator per leaf (never the full init)."""
    import jax
    import jax.numpy as jnp

    @functools.partial(jax.jit, static_argnums=(1, 2))
    def normal(key, shape, dtype):
        return (jax.random.normal(key, shape, dtype) * 0.02).astype(dtype)

    key = jax.random.PRNGKey(seed)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    out = []
    for i, (path, leaf) in enumerate(leaves):
        name = "/".join(str(getattr(p, "key", p)) for p in path)
        if "norm" in name:
            out.append(jnp.ones(leaf.shape, leaf.dtype))
        else:
            out.append(normal(jax.random.fold_in(key, i), tuple(leaf.shape), jnp.dtype(leaf.dtype)))
    return jax.tree_util.tree_unflatten(treedef, out)


def param_bytes(tree) -> int:
    import jax

    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))


def param_count(tree) -> int:
    import jax

    return int(sum(x.size for x in jax.tree.leaves(tree)))
