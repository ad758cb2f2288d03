"""The static description of a decoder: frozen dataclasses, hashable, usable as jit static
arguments. A leaf: it imports nothing of the models or the checkpoint formats. The families
(`dflash_jax.families`) parse a Hugging Face `config.json` into these; the decoder
(`dflash_jax.model`) reads them; RoPE's frequencies live with the model (`model/rope.py`).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

VERSION = "0.1.0"  # the package's version (dflash_jax.__version__), recorded in converted checkpoints
DTYPES = ("float32", "bfloat16")  # the dtypes a model computes in


def jnp_dtype(name: str):
    """The jax dtype of one of `DTYPES`."""
    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[name]


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # YaRN (gpt-oss): the ramp between interpolated and extrapolated frequencies, and the
    # factor cos and sin are multiplied by.
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0
    # Proportional (Gemma 4's full layers): only the first partial_rotary_factor of the pairs
    # rotate, at frequencies set by the whole head_dim; the rest have frequency 0 (identity).
    # Any other type (Qwen3.5): only the first partial_rotary_factor * head_dim dimensions
    # rotate, as a head of that size would; the rest pass through.
    partial_rotary_factor: float = 1.0

    def rotary_dim(self, head_dim: int) -> int:
        """How many leading dimensions of a head the rotation covers (its half-split is
        inside them)."""
        if self.type == "proportional" or self.partial_rotary_factor == 1.0:
            return head_dim
        return int(head_dim * self.partial_rotary_factor)


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """A sparse mixture-of-experts MLP block.

    router: "softmax_topk" (softmax over all experts, then the top k; Qwen3-MoE, which
        renormalises the k weights when `norm_topk_prob`) or "topk_softmax" (top k logits,
        then a softmax over those k; gpt-oss).
    activation: "silu" (silu(gate) * up), "gelu_tanh" (Gemma 4) or "clamped_swiglu" (gpt-oss:
        gate clamped above and up on both sides at `swiglu_limit`, (up + 1) * gate * sigmoid(alpha * gate)).
    fused_gate_up: gate and up live in one `gate_up_proj` [experts, hidden, 2 * inter],
        interleaved (gate = [..., 0::2], up = [..., 1::2]) as gpt-oss stores them.
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    router: str = "softmax_topk"
    norm_topk_prob: bool = False
    router_bias: bool = False
    expert_bias: bool = False
    fused_gate_up: bool = False
    activation: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # A dense "shared expert" MLP of this width every token goes through, scaled by
    # sigmoid(shared_expert_gate(x)) (Qwen3.5-MoE); 0: none.
    shared_expert_size: int = 0
    # Gemma 4: gate and up are the two halves of `gate_up_proj` (not interleaved); the router's
    # input is RMS-normed without weight, times a learned scale and hidden ** -0.5; each
    # expert's routing weight is times a learned per-expert scale.
    gate_up_halves: bool = False
    router_input_norm: bool = False
    per_expert_scale: bool = False
    # False: the shared expert is added ungated (DeepSeek-V3's `shared_experts`).
    shared_expert_gated: bool = True
    # router "sigmoid_grouped" (DeepSeek-V3's noaux_tc; MiniMax-M2 with one group): sigmoid scores;
    # experts are chosen on scores + a learned correction bias, first among the `topk_group` best of
    # `n_group` groups (a group's score: the sum of its two best), weighted by their plain scores
    # (renormalised when `norm_topk_prob`) times `routed_scaling_factor`.
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    # The router's logits computed in float32 from a float32 copy of its weight (DeepSeek-V3, GLM-5, as
    # transformers keeps that router), rather than in the model's dtype.
    router_float32: bool = False


@dataclasses.dataclass(frozen=True)
class LinearAttentionConfig:
    """The gated delta-net layers of a hybrid decoder (Qwen3.5): q/k heads and their size,
    value heads (a multiple of the q/k heads) and their size, the causal convolution's width."""

    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    conv_kernel: int = 4

    @property
    def conv_dim(self) -> int:
        return 2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim


@dataclasses.dataclass(frozen=True)
class IndexerConfig:
    """DeepSeek sparse attention's indexer (GLM-5): per query, `heads` scores of its own (a query from the
    q latent, one key per position of `head_dim`, RoPE on the first qk_rope_head_dim in interleaved pairs),
    relu'd and summed with learned per-head weights, pick the `top_k` cached positions the query attends
    to. A layer in `shared` runs no indexer: it attends to the previous indexer layer's positions."""

    heads: int
    head_dim: int
    top_k: int
    shared: tuple[bool, ...] = ()

    def is_shared(self, layer: int) -> bool:
        return bool(self.shared) and self.shared[layer]

    def slot(self, layer: int) -> int:
        """The layer's index into the cache's indexer keys (the indexer layers, in order)."""
        return sum(not self.is_shared(i) for i in range(layer))

    def num_slots(self, layers: int) -> int:
        return sum(not self.is_shared(i) for i in range(layers))


@dataclasses.dataclass(frozen=True)
class MlaConfig:
    """Multi-head latent attention (DeepSeek-V3, Kimi-K2, GLM-5). Queries: `q_lora_rank` (a low-rank
    down projection, its norm, an up projection) or one projection when None, each head
    `qk_nope_head_dim + qk_rope_head_dim` wide. Keys and values come from one latent per position:
    `kv_lora_rank` normed values plus `qk_rope_head_dim` rotated key values shared by every head
    (what the cache holds); `kv_b_proj` expands the latent into each head's non-rotated key
    (`qk_nope_head_dim`) and value (`v_head_dim`). rope_interleave: the rotated dimensions pair up
    as (0, 1), (2, 3), ... (DeepSeek's layout) rather than (i, i + half)."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    rope_interleave: bool = True
    indexer: IndexerConfig | None = None

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values the cache holds per position and layer: the latent and the rotated key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Static description of a decoder. Frozen and hashable: usable as a jit static arg."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    qk_norm: bool = False
    # With qk_norm: q_norm / k_norm are one RMSNorm over the whole projection (every head's
    # dimensions at once, a weight per element: heads * head_dim), applied before the split into
    # heads (MiniMax-M2's "per_layer" norm), not one per head. Under a mesh that splits heads over
    # `model` the norm's sum of squares spans the devices: XLA adds the all-reduce.
    qk_norm_whole: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    # Per layer: None (full attention) or the sliding window length.
    sliding_windows: tuple[int | None, ...] = ()
    # A learned per-head logit joins each softmax's denominator (gpt-oss).
    attention_sinks: bool = False
    # RMSNorm multiplies its weight in float32 before casting back (gpt-oss), not after.
    norm_weight_in_float32: bool = False
    # The sparse MLP block, and per layer whether it has one (else the dense MLP).
    moe: MoeConfig | None = None
    sparse_layers: tuple[bool, ...] = ()
    # Hybrid decoders (Qwen3.5): per layer whether it is a gated delta-net linear-attention
    # layer (a recurrent state, no KV cache) rather than attention.
    linear_attention: LinearAttentionConfig | None = None
    linear_layers: tuple[bool, ...] = ()
    # Attention output times sigmoid(gate), the gate a second half of each q_proj head (Qwen3.5).
    attention_output_gate: bool = False
    # RMSNorm weights are offsets from 1: x * (1 + w) (Qwen3.5).
    norm_zero_centered: bool = False
    # Gemma 4. Full-attention ("global") layers with their own head_dim, KV heads and RoPE
    # (None: the config's); their values may be their keys (attention_k_eq_v: the key
    # projection before k_norm, then the value norm).
    global_head_dim: int | None = None
    global_kv_heads: int | None = None
    global_rope: RopeConfig | None = None
    attention_k_eq_v: bool = False
    # Per layer: the earlier layer whose K/V it reads instead of its own (KV sharing), or None.
    kv_shared_from: tuple[int | None, ...] = ()
    value_norm: bool = False  # an RMSNorm without weight on the values
    attention_scale: float | None = None  # the softmax's scale (None: head_dim ** -0.5)
    # "pre": input_layernorm before attention, post_attention_layernorm before the MLP (Llama);
    # "sandwich": each block's input and output normed (Gemma: post_attention_layernorm on the
    # attention output, pre_/post_feedforward_layernorm around the MLP).
    block_norms: str = "pre"
    embed_scale: bool = False  # embeddings times sqrt(hidden) (rounded to the dtype, as HF)
    final_logit_softcap: float | None = None  # logits -> cap * tanh(logits / cap)
    mlp_activation: str = "silu"  # "silu" or "gelu_tanh" (the gated MLP's and the experts')
    layer_scalar: bool = False  # a learned scalar multiplies each layer's output
    # Per-layer inputs (Gemma 4 E2B/E4B): a per_layer_input_size slice of a second embedding
    # (and of a projection of the first) feeds each layer through a small gated projection.
    per_layer_input_size: int = 0
    per_layer_vocab_size: int = 0
    # Multi-head latent attention on every attention layer (DeepSeek-V3): head_dim is then the
    # rotated part's width (RoPE's), and the cache holds one latent per position (`kv.init_cache`).
    mla: MlaConfig | None = None
    dtype: str = "float32"
    # How the linear layers' weights are stored on the device (`dflash_jax.model.weights`: a
    # registered format's name for all of them, or `FormatRules`, a format per weight by its path;
    # "dense": the weights themselves, in `dtype`).
    weight_format: str | tuple[tuple[str, str], ...] = "dense"

    @property
    def num_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    def is_sparse(self, layer: int) -> bool:
        return bool(self.sparse_layers) and self.sparse_layers[layer]

    def is_linear(self, layer: int) -> bool:
        return bool(self.linear_layers) and self.linear_layers[layer]

    @property
    def num_attention_layers(self) -> int:
        """Attention layers (every layer but the linear-attention ones)."""
        return self.num_hidden_layers - sum(self.linear_layers)

    @property
    def num_linear_layers(self) -> int:
        return sum(self.linear_layers)

    def is_global(self, layer: int) -> bool:
        """A full-attention layer with its own head shape (Gemma 4's global layers)."""
        return (self.global_head_dim is not None or self.global_kv_heads is not None) and not (
            self.sliding_windows and self.sliding_windows[layer]) and not self.is_linear(layer)

    def local_window(self) -> int | None:
        """The widest window of the main K/V group when every attention layer in it slides (Gemma 4's
        sliding layers, beside their global group; a Mistral-style decoder), else None: such a group
        never reads a key older than that window."""
        layers = [i for i in range(self.num_hidden_layers) if not self.is_linear(i) and not self.is_global(i)]
        windows = [self.sliding_windows[i] if self.sliding_windows else None for i in layers]
        return max(windows) if layers and None not in windows else None

    def attention_shape(self, layer: int) -> tuple[int, int]:
        """(head_dim, KV heads) of an attention layer."""
        if self.is_global(layer):
            return self.global_head_dim or self.head_dim, self.global_kv_heads or self.num_key_value_heads
        return self.head_dim, self.num_key_value_heads

    def cache_shape(self, global_group: bool = False) -> tuple[int, int]:
        """(KV heads, head_dim) of a K/V group's cache entries (MLA's latent cache: `dflash_jax.kv.init_cache`)."""
        if global_group:
            g = next(i for i in range(self.num_hidden_layers) if self.is_global(i))
            head_dim, kv_heads = self.attention_shape(g)
            return kv_heads, head_dim
        return self.num_key_value_heads, self.head_dim

    def layer_rope(self, layer: int) -> RopeConfig:
        return self.global_rope if self.is_global(layer) and self.global_rope is not None else self.rope

    def kv_producer(self, layer: int) -> int:
        """The layer whose K/V this layer attends over: itself, or the one it shares."""
        shared = self.kv_shared_from[layer] if self.kv_shared_from else None
        return layer if shared is None else shared

    def cache_slot(self, layer: int) -> int:
        """The layer's index into its cache: into the KV buffers of its group (`is_global`) for
        an attention layer (a layer sharing K/V: its producer's), into the recurrent states
        for a linear one."""
        if self.is_linear(layer):
            return sum(self.is_linear(i) for i in range(layer))
        layer = self.kv_producer(layer)
        return sum(self.kv_producer(i) == i and not self.is_linear(i) and self.is_global(i) == self.is_global(layer)
                   for i in range(layer))

    def num_kv_slots(self, global_group: bool) -> int:
        """KV buffer slots of a group: its attention layers that keep their own K/V."""
        return sum(self.kv_producer(i) == i and not self.is_linear(i) and self.is_global(i) == global_group
                   for i in range(self.num_hidden_layers))
