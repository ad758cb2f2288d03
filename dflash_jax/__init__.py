"""dflash-jax: DFlash speculative decoding (arXiv 2602.06036) in JAX/Flax.

Its packages: `model` (the one decoder), `families` (what each Hugging Face `model_type` turns
on), `kv` (the KV cache), `attention` (the one attention interface and its implementations),
`engine` (the decoding engine: the device step, batching, serving), `constrain` (structured
output's host side: a request's constraint compiled to a token automaton).

Its modules: `config` (`ModelConfig`), `drafter` (the DFlash drafter), `dflash2` (what a DFlash2
drafter adds), `pair` (a target and its drafter loaded), `chat` (prompts to token ids),
`generation` (batch generation from JSONL rows as a job), `checkpoint`, `safetensors_io`, `fp8`
and `convert` (loading and converting checkpoints), `training` and `data` (the drafter's training
step and data), `sharding` (meshes), `aot` and `shapes` (compiling for a TPU on any machine, and
published models' shapes), `compiling` (the persistent compilation cache, compile counts),
`platform` (the platform traced for), `errors`.
"""

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
