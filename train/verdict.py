"""What a run's eval tau means: a few lines for the end of `python -m train`.

tau is the mean number of tokens a decoding cycle commits (the accepted drafts plus the target's
own next token), so 1.0 means no draft token was ever accepted and a block of B tokens can reach B
at most. Whether a figure is good depends on the run's size and target, so a config may say what
it reaches (`train.expect_tau`, measured, with `train.expect_note` saying why); the reference
figures below say what a useful drafter reaches. Every figure here is one the repository measured
or cites, with its source (docs/training.md, "Judging a run").
"""

from __future__ import annotations

# An end tau within this of `train.expect_tau` is "as expected" (the held-out evals are a few dozen
# prompts, so a rerun on another machine can differ by a few hundredths).
TAU_TOLERANCE = 0.05
# A run whose eval tau rose by less than this did not learn to draft.
MIN_GAIN = 0.02

# The bundled demo drafter (docs/demo.md; dflash_jax/demo/drafter/train_log*.jsonl): 8 stages,
# 1600 + 1800 + 2200 + 2000 + 1500 + 1800 + 1400 + 450 steps of 16 sequences of 320 tokens, on about
# 65,000 of the demo target's continuations (160 tokens each); its training eval (32 held-out stdlib
# continuations, block 16) went 1.00 -> 3.27, and the benchmark's held-out numpy prompts give 3.67.
DEMO_STEPS = 12_750
DEMO_EVAL_TAU = 3.27
DEMO_HELDOUT_TAU = 3.67
# The paper's Qwen3-8B drafter, block 16, greedy, averaged over its benchmarks (DFlash, arXiv
# 2602.06036; the same figure as bench/published.py's PAPER_TAU), trained on 800k regenerated
# conversations for 6 epochs (configs/train/qwen3-8b.yaml is that recipe).
PAPER_TAU = 6.49
# A DFlash cycle's cost in plain decoding steps, which tau must clearly exceed for any speedup
# (docs/benchmarks.md): Qwen3-8B at context 1024, 1.18 (H200 roofline) to 1.43 (v5p compiler, batch 8
# estimate); the demo pair at block 16 on a 2-core CPU, 4.8.
BREAK_EVEN_ACCELERATOR = (1.2, 1.4)
BREAK_EVEN_DEMO_CPU = 4.8


def verdict(start_tau: float | None, end_tau: float | None, steps: int, config: dict,
            start_step: int = 0) -> list[str]:
    """The end-of-run judgement of eval taus `start_tau` (at `start_step`) -> `end_tau` after `steps`
    steps of a run with `config` (train/config.py's dict): what happened, whether it is what this
    config reaches, and what a useful drafter reaches. Pure: no I/O."""
    t, d = config["train"], config["data"]
    expect, note = t.get("expect_tau"), t.get("expect_note")
    size = f"{steps} steps of {t['global_batch']} x {d['seq_len']} tokens"
    if end_tau is None:
        lines = [f"verdict: no eval tau measured ({size}; data.eval_holdout is 0)",
                 "  decode held-out prompts with the exported drafter (python -m infer) to judge it"]
    else:
        start_txt = f"{start_tau:.3f} (step {start_step})" if start_tau is not None else "(no start figure)"
        lines = [f"verdict: eval tau {start_txt} -> {end_tau:.3f} after {size}",
                 "  tau = tokens committed per decoding cycle; 1.0 = no draft token ever accepted"]
        gain = None if start_tau is None else end_tau - start_tau
        if gain is not None and gain < MIN_GAIN:
            lines.append(f"  NOT IMPROVED ({gain:+.3f}): check that the loss fell (metrics.jsonl), that the data "
                         "is the target's own output, and the learning rate")
        if expect is not None:
            if end_tau >= expect - TAU_TOLERANCE:
                word = "above expectation" if end_tau > expect + TAU_TOLERANCE else "as expected"
            else:
                word = "BELOW EXPECTATION"
            lines.append(f"  {word}: this config as written reaches about {expect:.2f} (train.expect_tau)")
            if note:
                lines.append(f"  ({note})")
        elif gain is None or gain >= MIN_GAIN:
            lines.append("  this config names no expected tau (train.expect_tau); compare with the figures below")
    lo, hi = BREAK_EVEN_ACCELERATOR
    lines += [f"  for scale: the bundled demo drafter reached {DEMO_EVAL_TAU:.2f} on its held-out eval, "
              f"{DEMO_HELDOUT_TAU:.2f} on unseen numpy",
              f"    code, after {DEMO_STEPS:,} steps of 16 x 320 tokens (docs/demo.md); the paper's Qwen3-8B "
              f"drafter: {PAPER_TAU}",
              f"  a speedup needs tau well above a cycle's cost in plain decoding steps: {lo}-{hi} for "
              "Qwen3-8B on",
              f"    an accelerator, {BREAK_EVEN_DEMO_CPU} for the demo pair on a 2-core CPU (docs/benchmarks.md)"]
    return lines
