"""`python -m train.demo_target`: train the bundled demo target from the Python standard library.

A small Qwen3-architecture causal LM, trained (seeded, resumable) on the `.py` files of the
running Python's standard library (tests excluded) - a corpus every machine has - with a
byte-level BPE tokenizer trained on the same files and a ChatML chat template, saved as a
Hugging Face checkpoint that `transformers` loads as `Qwen3ForCausalLM`.

    python -m train.demo_target --out dflash_jax/demo/target --force   # the bundled target, about an hour

The model is our own Flax decoder (`dflash_jax.model`); the weights are written with the
same name table the loader reads, so the result is an ordinary HF directory.
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import sys
import sysconfig
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MODEL = dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=6, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, max_position_embeddings=1024, rope_theta=10000.0,
             rms_norm_eps=1e-6, tie_word_embeddings=True)


def stdlib_files(exclude_tests: bool = True) -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idle_test", "site-packages", "__pycache__"}
    files = sorted(f for f in root.rglob("*.py") if not (exclude_tests and skip & set(f.relative_to(root).parts)))
    return files


def read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return ""


def train_tokenizer(files: list[Path], vocab_size: int, out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator((read_text(f) for f in files), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, unk_token=None, mask_token="<|mask|>",
                                   additional_special_tokens=["<|im_start|>", "<|endoftext|>"])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def token_stream(tokenizer, files: list[Path]) -> np.ndarray:
    eot = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    ids = []
    for f in files:
        text = read_text(f)
        if text.strip():
            ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
            ids.append(eot)
    return np.asarray(ids, np.int32)


def hf_config(tokenizer) -> dict:
    eos = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **MODEL,
            "hidden_act": "silu", "attention_bias": False, "use_sliding_window": False, "sliding_window": None,
            "bos_token_id": None, "eos_token_id": eos[0], "pad_token_id": eos[1], "torch_dtype": "float32",
            "dtype": "float32"}


def make_step(config, tx):
    from dflash_jax.kv import init_cache
    from dflash_jax.model import forward

    def loss_fn(params, tokens):
        b, s = tokens.shape
        out = forward(params, config, tokens[:, :-1], init_cache(config, b, s - 1))
        logp = jax.nn.log_softmax(out.logits, -1)
        return -jnp.take_along_axis(logp, tokens[:, 1:, None], -1).mean()

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step, jax.jit(loss_fn)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m train.demo_target", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="HF output directory (written at the end, atomically)")
    p.add_argument("--work", default=None, help="checkpoints and logs (default: OUT.work); rerun to resume")
    p.add_argument("--steps", type=int, default=2000, help="2000 (the bundled target): about an hour on 2 cores")
    p.add_argument("--batch", type=int, default=24)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--force", action="store_true")
    args = p.parse_args(argv)

    import orbax.checkpoint as ocp
    from tqdm import tqdm

    from dflash_jax.checkpoint import save_hf_params, target_table
    from dflash_jax.families import model_config
    from dflash_jax.model import init_params

    out = Path(args.out)
    work = Path(args.work or f"{out}.work")
    if out.exists() and not args.force:
        print(f"error: {out} already exists; pass --force to overwrite it", file=sys.stderr)
        return 2
    work.mkdir(parents=True, exist_ok=True)
    files = stdlib_files()
    tok_dir = work / "tokenizer"
    if not (tok_dir / "tokenizer.json").is_file():
        print(f"training the tokenizer on {len(files)} stdlib files ...", file=sys.stderr)
        train_tokenizer(files, MODEL["vocab_size"], tok_dir)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    stream_path = work / "tokens.npy"
    if not stream_path.is_file():
        np.save(stream_path, token_stream(tokenizer, files))
    stream = np.load(stream_path)
    print(f"corpus: {len(files)} files, {len(stream):,} tokens", file=sys.stderr)

    hf = hf_config(tokenizer)
    config = model_config(hf)
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, max(1, args.steps // 25), args.steps, args.lr * 0.05)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.1))
    params = init_params(config, jax.random.PRNGKey(args.seed))
    # Small init for the residual outputs keeps early training stable.
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: x * 0.5 if any(getattr(k, "key", "") in ("o_proj", "down_proj") for k in path) else x, params)
    state = {"params": params, "opt_state": tx.init(params)}
    mngr = ocp.CheckpointManager((work / "checkpoints").absolute(), options=ocp.CheckpointManagerOptions(max_to_keep=2))
    start = mngr.latest_step() or 0
    if start:
        state = mngr.restore(start, args=ocp.args.StandardRestore(jax.eval_shape(lambda: state)))
        print(f"resumed at step {start}", file=sys.stderr)
    step_fn, eval_loss = make_step(config, tx)

    n_windows = (len(stream) - 1) // args.seq_len
    held = stream[-(64 * args.seq_len + 1):]  # the last windows are never trained on
    n_windows -= 64

    def batch_at(step: int) -> jnp.ndarray:
        # Seeded sampling of windows by step: a resumed run sees exactly the same batches.
        rng = np.random.default_rng([args.seed, step])
        starts = rng.integers(0, n_windows, args.batch) * args.seq_len
        return jnp.asarray(np.stack([stream[s:s + args.seq_len + 1] for s in starts]))

    eval_batch = jnp.asarray(held[: 64 * args.seq_len].reshape(64, args.seq_len)[:16])
    log = open(work / "log.jsonl", "a")
    bar = tqdm(total=args.steps, initial=start, desc="demo target", unit="step", file=sys.stderr)
    t0 = time.perf_counter()
    params, opt_state = state["params"], state["opt_state"]
    for step in range(start, args.steps):
        params, opt_state, loss = step_fn(params, opt_state, batch_at(step))
        done = step + 1
        if done % 25 == 0 or done == args.steps:
            entry = {"step": done, "loss": round(float(loss), 4), "seconds": round(time.perf_counter() - t0, 1)}
            if done % 100 == 0 or done == args.steps:
                entry["heldout_loss"] = round(float(eval_loss(params, eval_batch)), 4)
            log.write(json.dumps(entry) + "\n")
            log.flush()
            bar.set_postfix(loss=f"{entry['loss']:.3f}")
        if done % args.save_every == 0 or done == args.steps:
            mngr.save(done, args=ocp.args.StandardSave({"params": params, "opt_state": opt_state}))
        bar.update(1)
    bar.close()
    mngr.wait_until_finished()

    tmp = out.parent / f".{out.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(tok_dir, tmp)
    (tmp / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    (tmp / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [hf["eos_token_id"], hf["pad_token_id"]], "pad_token_id": hf["pad_token_id"]}, indent=2) + "\n")
    save_hf_params(params, tmp / "model.safetensors", table=target_table(config.model_type))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
