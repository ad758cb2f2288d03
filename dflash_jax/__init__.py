"""dflash-jax: DFlash speculative decoding (arXiv 2602.06036) in JAX/Flax."""

from dflash_jax.config import VERSION, ModelConfig
from dflash_jax.errors import CheckpointError, ConfigError, DFlashError
from dflash_jax.kv import KVCache, init_cache
from dflash_jax.model import CausalLM, ForwardOutput, forward
from dflash_jax.checkpoint import load_drafter, load_target

__all__ = [
    "ModelConfig", "CausalLM", "KVCache", "ForwardOutput", "forward", "init_cache",
    "load_target", "load_drafter", "DFlashError", "ConfigError", "CheckpointError",
]
__version__ = VERSION
