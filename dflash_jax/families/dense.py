"""Dense decoders: Llama, Qwen2, Qwen3, Mistral. The same layer, told apart by switches."""

from dflash_jax.families.registry import Family, register
from dflash_jax.families.table import decoder_rows

TABLE = decoder_rows()

register(Family("qwen3", dict(qk_norm=True, qkv_bias="attention_bias", o_bias="attention_bias", mlp_bias=False), TABLE))
register(Family("llama", dict(qkv_bias="attention_bias", o_bias="attention_bias", mlp_bias="mlp_bias"), TABLE))
register(Family("qwen2", dict(qkv_bias=True), TABLE))
register(Family("mistral", dict(all_sliding=True), TABLE))
