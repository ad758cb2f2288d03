"""--moe-cost: what a DFlash cycle costs against a decoding step for mixture-of-experts targets.

A dense target reads all its weights in a decoding step and again in a verify pass, so a
16-token verify costs about what one step does while decoding is memory-bound. A MoE target
reads only the experts its tokens are routed to: one token touches k experts per layer, a
verify of batch x 16 tokens touches many more. That is the cost DFlash pays on MoE targets.

The expected number of distinct experts that T tokens touch in a layer, if each token picks
its k of E experts uniformly and independently, is E (1 - (1 - k/E)^T). Real routing is
skewed and a row's tokens are correlated (neighbouring tokens often share experts), so fewer
are touched; uniform routing is the pessimistic end.

Bytes of a step, memory-bound: per layer the attention and router weights, the touched
experts' weights and the K/V in use (sliding layers: their window), plus the LM head and the
embedding rows looked up. A DFlash cycle: the target's verify of batch x B tokens, the
drafter's dense layers and its context K/V, and the LM head read again for the drafts.
Parameter shapes come from the model's own abstract parameters (`jax.eval_shape`, nothing
allocated) built from each published config; weights count in bfloat16 (gpt-oss's MXFP4
experts are dequantized to bfloat16 at load). Rooflines: max(flops / peak, bytes / bandwidth).
"""

from __future__ import annotations

from bench.cost import HARDWARE
from dflash_jax.shapes import PUBLISHED_MOE
from bench.report import fmt_gb

DRAFTER_LAYERS = 5  # the z-lab recipe's drafter depth (as the Qwen3-8B drafter); dense Qwen3 layers
DRAFTER_MLP = 3  # drafter MLP width as a multiple of hidden (an assumption: the drafters' own widths vary)
BYTES = 2  # bfloat16


def expected_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts of one layer touched by `tokens` tokens routed uniformly and
    independently to top_k of num_experts each."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def _leaf_bytes(tree) -> dict[str, int]:
    import jax
    import numpy as np

    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        out["/".join(str(getattr(k, "key", k)) for k in path)] = int(np.prod(leaf.shape)) * BYTES
    return out


def target_pieces(config) -> dict:
    """Bytes of the target's weights by kind, from its abstract parameters."""
    from dflash_jax.model import abstract_params

    leaves = _leaf_bytes(abstract_params(config))
    experts = sum(v for k, v in leaves.items() if "/experts/" in k)
    sparse = sum(config.sparse_layers)
    e = config.moe.num_experts
    return dict(
        expert=experts / (sparse * e),  # one expert of one layer
        sparse_layers=sparse,
        embedding=leaves["model/embed_tokens/embedding"],
        lm_head=leaves.get("lm_head/kernel", leaves["model/embed_tokens/embedding"]),
        always=sum(v for k, v in leaves.items() if "/experts/" not in k and not k.startswith(("lm_head", "model/embed"))),
    )


def kv_bytes(config, batch: int, context: int) -> int:
    per_position = config.num_key_value_heads * config.head_dim * 2 * BYTES
    windows = config.sliding_windows or (None,) * config.num_hidden_layers
    return sum(batch * min(context, w or context) * per_position for w in windows)


def step_cost(config, pieces: dict, batch: int, tokens_per_row: int, context: int) -> dict:
    """Bytes and flops of one target pass over batch x tokens_per_row tokens at `context`."""
    t = batch * tokens_per_row
    moe = config.moe
    touched = expected_experts(moe.num_experts, moe.top_k, t)
    active = pieces["always"] + pieces["sparse_layers"] * moe.top_k * pieces["expert"] + pieces["lm_head"]
    nbytes = (pieces["always"] + pieces["sparse_layers"] * touched * pieces["expert"] + pieces["lm_head"]
              + t * pieces["embedding"] / config.vocab_size + kv_bytes(config, batch, context))
    attn_flops = 4 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * context * t
    return dict(tokens=t, experts_touched=touched, bytes=nbytes, flops=2 * active / BYTES * t + attn_flops)


def drafter_cost(config, batch: int, block: int, context: int) -> dict:
    h = config.hidden_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    layer = (2 * h * q + 2 * h * kv + 3 * h * DRAFTER_MLP * h) * BYTES
    weights = DRAFTER_LAYERS * layer + 5 * h * h * BYTES  # + fc over 5 taps
    ctx_kv = DRAFTER_LAYERS * batch * context * kv * 2 * BYTES
    lm_head = config.vocab_size * h * BYTES  # the target's head, read again for the drafts
    t = batch * block
    return dict(bytes=weights + ctx_kv + lm_head, flops=2 * (weights + lm_head) / BYTES * t)


def moe_report(name: str, hf: dict, batch: int, context: int, block: int, tau: float) -> dict:
    from dflash_jax.families import model_config

    config = model_config(hf)
    pieces = target_pieces(config)
    ar = step_cost(config, pieces, batch, 1, context)
    verify = step_cost(config, pieces, batch, block, context)
    draft = drafter_cost(config, batch, block, context)
    cycle = dict(bytes=verify["bytes"] + draft["bytes"], flops=verify["flops"] + draft["flops"])
    out = dict(model=name, batch_size=batch, context=context, block_size=block, tau=tau,
               experts=config.moe.num_experts, top_k=config.moe.top_k, layers=config.num_hidden_layers,
               expert_bytes=pieces["expert"], always_bytes=pieces["always"], lm_head_bytes=pieces["lm_head"],
               ar=ar, verify=verify, drafter=draft, cycle=cycle, hardware={})
    for hw in HARDWARE:
        t_ar, b_ar = hw.roofline(ar["flops"], ar["bytes"])
        t_cy, b_cy = hw.roofline(cycle["flops"], cycle["bytes"])
        out["hardware"][hw.name] = dict(ar_seconds=t_ar, ar_bound=b_ar, cycle_seconds=t_cy, cycle_bound=b_cy,
                                        cost_ratio=t_cy / t_ar, projected_speedup=tau * t_ar / t_cy,
                                        break_even_tau=t_cy / t_ar)
    return out


def run_moe_cost(args) -> dict:
    batches = [args.batch_size] if args.batch_size else [1, 8]
    tau, block = args.paper_tau, 16
    print(f"MoE targets, bfloat16 weights, context {args.context}, DFlash block {block}, drafter {DRAFTER_LAYERS} "
          f"dense layers (MLP {DRAFTER_MLP}x hidden, assumed); expected experts touched under uniform routing "
          f"(pessimistic: real routing is skewed and correlated)")
    reports = []
    for name, hf in PUBLISHED_MOE.items():
        for batch in batches:
            r = moe_report(name, hf, batch, args.context, block, tau)
            reports.append(r)
            print(f"\n{name} ({r['layers']} layers, {r['experts']} experts, top-{r['top_k']}; one expert "
                  f"{fmt_gb(r['expert_bytes'])} per layer), batch {batch}:")
            print(f"  AR step:   {r['ar']['tokens']:5d} tokens, {r['ar']['experts_touched']:6.1f} experts touched per "
                  f"layer, {fmt_gb(r['ar']['bytes'])}")
            print(f"  verify:    {r['verify']['tokens']:5d} tokens, {r['verify']['experts_touched']:6.1f} experts "
                  f"touched per layer, {fmt_gb(r['verify']['bytes'])}; drafter + LM head again "
                  f"{fmt_gb(r['drafter']['bytes'])}")
            for hw_name, f in r["hardware"].items():
                print(f"  {hw_name}: cycle / AR step {f['cost_ratio']:.2f} ({f['cycle_bound']}-bound cycle, "
                      f"{f['ar_bound']}-bound step); projected speedup at tau {tau}: {f['projected_speedup']:.2f}x "
                      f"(break-even tau {f['break_even_tau']:.2f})")
    dense_note = ("a dense target's verify reads the same weights as its step (cost ratio ~1.1-1.2 in `--cost`); "
                  "a MoE verify reads the experts of batch x 16 tokens instead of batch x 1")
    print(f"\n({dense_note})")
    return dict(reports=reports, note=dense_note, assumptions=dict(
        drafter_layers=DRAFTER_LAYERS, drafter_mlp_multiple=DRAFTER_MLP, bytes_per_weight=BYTES,
        routing="uniform, independent (expected distinct experts E(1-(1-k/E)^T))"))
