"""The target under Hugging Face transformers `generate` (PyTorch, CPU): the reference."""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path


def bench_transformers(target_dir: Path, dtype: str, prompts, batch_sizes, max_new_tokens: int, repeats: int,
                       reference_outputs, threads: int | None) -> dict:
    """The target under Hugging Face transformers `generate` (PyTorch, CPU), greedy, exactly
    max_new_tokens per row (stop tokens off), left-padded batches."""
    try:
        import torch
        import transformers
    except ImportError as e:
        return dict(skipped=f"torch/transformers not importable ({e})")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if threads:
        torch.set_num_threads(threads)
    transformers.utils.logging.disable_progress_bar()
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    t = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch_dtype).eval()
    load_seconds = time.perf_counter() - t
    cfg = model.config
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else 0
    gen_cfg = transformers.GenerationConfig(
        do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, eos_token_id=None,
        pad_token_id=pad, bos_token_id=cfg.bos_token_id,
    )
    model.generation_config = gen_cfg  # no stop tokens: every row gets exactly max_new_tokens

    def run(batch_prompts):
        width = max(len(p) for p in batch_prompts)
        ids = torch.full((len(batch_prompts), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch_prompts), width), dtype=torch.long)
        for i, p in enumerate(batch_prompts):
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p):] = 1
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gen_cfg)
        return [row[width:].tolist() for row in out]

    rows = []
    for batch in batch_sizes:
        run(prompts[:batch])  # warm-up
        secs, outputs = [], []
        for _ in range(repeats):
            outputs = []
            t = time.perf_counter()
            for s in range(0, len(prompts), batch):
                outputs += run(prompts[s:s + batch])
            secs.append(time.perf_counter() - t)
        tokens = sum(len(o) for o in outputs)
        seconds = statistics.median(secs)
        rows.append(dict(
            batch_size=batch, tokens_per_second=tokens / seconds, tokens_per_second_runs=[tokens / s for s in secs],
            seconds=seconds, output_tokens=tokens,
            rows_matching_baseline=sum(a == b for a, b in zip(outputs, reference_outputs)),
            outputs=outputs,
        ))
    return dict(torch_version=torch.__version__, transformers_version=transformers.__version__,
                torch_threads=torch.get_num_threads(), dtype=dtype, load_seconds=load_seconds, rows=rows)
