"""Rows of the HF <-> Flax name table, and the rows every family shares.

Each row names an HF tensor, the Flax path it fills and the transform between them (HF
Linear weights are [out, in], Flax kernels [in, out]). `{i}` in a name stands for a layer
index; `{e}` for an expert index: the HF tensor of expert e fills slice e of a stacked
`[experts, ...]` parameter. A row with a `part` is one of the tensors a parameter is built
from (MXFP4 `*_blocks` + `*_scales`); its family's `combine` builds the parameter.
"""

from __future__ import annotations

import dataclasses
import re


@dataclasses.dataclass(frozen=True)
class Row:
    hf: str  # HF tensor name; `{i}` a layer index, `{e}` an expert index
    flax: str  # "/"-joined Flax path, same `{i}`
    transpose: bool = False  # HF Linear [out, in] <-> Flax kernel [in, out] (the last two axes)
    part: str | None = None  # one of several tensors a parameter is built from (e.g. "blocks")
    piece: str | None = None  # one of several parameters an HF tensor is cut into (e.g. "qkv")

    @property
    def stacked(self) -> bool:
        return "{e}" in self.hf

    @property
    def regex(self) -> re.Pattern:
        pattern = re.escape(self.hf)
        for key in ("i", "e"):
            pattern = pattern.replace(re.escape("{%s}" % key), rf"(?P<{key}>\d+)")
        return re.compile(pattern + "$")


def attention_rows(hf_prefix: str, flax_prefix: str) -> list[Row]:
    rows = []
    for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
        rows.append(Row(f"{hf_prefix}self_attn.{p}.weight", f"{flax_prefix}self_attn/{p}/kernel", True))
        rows.append(Row(f"{hf_prefix}self_attn.{p}.bias", f"{flax_prefix}self_attn/{p}/bias"))
    for norm in ("self_attn.q_norm", "self_attn.k_norm", "input_layernorm", "post_attention_layernorm"):
        rows.append(Row(f"{hf_prefix}{norm}.weight", f"{flax_prefix}{norm.replace('.', '/')}/weight"))
    rows.append(Row(f"{hf_prefix}self_attn.sinks", f"{flax_prefix}self_attn/sinks"))
    return rows


def dense_mlp_rows(hf_prefix: str, flax_prefix: str) -> list[Row]:
    rows = []
    for p in ("gate_proj", "up_proj", "down_proj"):
        rows.append(Row(f"{hf_prefix}mlp.{p}.weight", f"{flax_prefix}mlp/{p}/kernel", True))
        rows.append(Row(f"{hf_prefix}mlp.{p}.bias", f"{flax_prefix}mlp/{p}/bias"))
    return rows


def layer_rows(hf_prefix: str, flax_prefix: str) -> list[Row]:
    """A dense decoder layer (attention + gated MLP): the drafter's and dense targets' layer."""
    return attention_rows(hf_prefix, flax_prefix) + dense_mlp_rows(hf_prefix, flax_prefix)


def decoder_rows(*moe_rows) -> tuple[Row, ...]:
    """The table of a `*ForCausalLM`: embeddings, layers (dense rows plus a family's MoE
    rows), final norm, head."""
    prefix, flax_prefix = "model.layers.{i}.", "model/layers_{i}/"
    return (
        Row("model.embed_tokens.weight", "model/embed_tokens/embedding"),
        *layer_rows(prefix, flax_prefix),
        *[row for rows in moe_rows for row in rows(prefix, flax_prefix)],
        Row("model.norm.weight", "model/norm/weight"),
        Row("lm_head.weight", "lm_head/kernel", True),
    )
