"""`python -m train.generate_data`: the target regenerates the responses of a prompt set.

DFlash drafters learn to predict what *their target* would write, so training data is the
target's own output: this runs the job of `python -m infer` (the same flags, `infer.flags`; the
same `dflash_jax.generation.run_job`, batch engine and resume: rerunning with the same --output
skips finished ids) with `conversation_record` shaping its lines:

  {"id", "messages": [..., {"role": "assistant", "content": answer}]}   chat prompts, with a tokenizer
  {"id", "prompt": text, "response": text}                              raw text prompts
and always "prompt_ids" (the exact prompt tokens) and "response_ids" (the target's tokens),
plus "finish_reason". `turns` rows keep every turn's answer in "messages". The trainer
(`data.generate_from`) runs the same job as a `GenerationJob`.
"""

from __future__ import annotations

import argparse
import sys

from infer.flags import HelpFormatter, add_distributed_flags, add_generation_flags


def conversation_record(row, record, conversation) -> dict:
    out = {"id": row.id}
    text = record.get("text")
    if conversation is not None and text is not None:
        out["messages"] = list(conversation) + [{"role": "assistant", "content": text}]
    elif row.kind == "prompt" and text is not None:
        out["prompt"], out["response"] = row.value, text
    out["prompt_ids"] = row.turn_ids[-1]
    out["response_ids"] = record["output_ids"]
    out["finish_reason"] = record["finish_reason"]
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m train.generate_data",
        description="Regenerate responses with the target (optionally sped up by a drafter) and write "
                    "conversations JSONL for `python -m train`. Same flags as `python -m infer`.",
        formatter_class=HelpFormatter)
    add_generation_flags(parser)
    add_distributed_flags(parser)
    return parser


def main(argv=None) -> int:
    from infer.cli import run

    args = build_parser().parse_args(argv)
    if args.output is None:
        print("error: --output is required", file=sys.stderr)
        return 2
    return run(args, make_record=conversation_record)


if __name__ == "__main__":
    sys.exit(main())
