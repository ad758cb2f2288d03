"""Peak host memory of `python -m dflash_jax.convert` on a random ~1 GB checkpoint.

Writes a random float32 Qwen3 checkpoint with our own safetensors writer (no torch), then
runs the conversion (and, separately, a plain load) in child processes and prints each
one's peak RSS against the checkpoint size and against the RSS of a bare `import jax`.
Prints figures; asserts nothing.

    python bench/convert_memory.py [--layers 16] [--workdir /tmp/dflash-mem]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def write_checkpoint(path: Path, layers: int, hidden: int, inter: int, vocab: int) -> int:
    from dflash_jax.safetensors_io import save_file

    heads, kv_heads, head_dim = hidden // 64, hidden // 128, 64
    cfg = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=vocab,
               hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
               num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
               rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=4096,
               tie_word_embeddings=False, torch_dtype="float32")
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    rng = np.random.default_rng(0)
    r = lambda *s: rng.standard_normal(s, dtype=np.float32) * 0.02
    tensors = {"model.embed_tokens.weight": r(vocab, hidden), "model.norm.weight": np.ones(hidden, np.float32),
               "lm_head.weight": r(vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors.update({
            p + "self_attn.q_proj.weight": r(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": r(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": r(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": r(hidden, heads * head_dim),
            p + "self_attn.q_norm.weight": np.ones(head_dim, np.float32),
            p + "self_attn.k_norm.weight": np.ones(head_dim, np.float32),
            p + "mlp.gate_proj.weight": r(inter, hidden),
            p + "mlp.up_proj.weight": r(inter, hidden),
            p + "mlp.down_proj.weight": r(hidden, inter),
            p + "input_layernorm.weight": np.ones(hidden, np.float32),
            p + "post_attention_layernorm.weight": np.ones(hidden, np.float32),
        })
    save_file(tensors, path / "model.safetensors")
    return (path / "model.safetensors").stat().st_size


def peak_rss_of(code: str, devices: int = 1) -> tuple[float, float]:
    """(peak RSS in bytes, seconds) of `python -c code` in a fresh child process."""
    import os

    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", code + "\nimport resource,sys;"
         "print('PEAK', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)"],
        capture_output=True, text=True, env=env)
    if proc.returncode:
        raise SystemExit(proc.stderr)
    kib = int(proc.stderr.rsplit("PEAK", 1)[1].split()[0])
    return kib * 1024, time.perf_counter() - start


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=3072)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--workdir", default="/tmp/dflash-convert-mem")
    ap.add_argument("--mesh", default="model=8", help="also load onto this mesh of CPU devices")
    ap.add_argument("--devices", type=int, default=8, help="CPU devices for --mesh")
    args = ap.parse_args()
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    # Written in a child: a forked child's ru_maxrss starts from the parent's RSS, so the
    # parent must stay small for the measurements below to mean anything.
    peak_rss_of(f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
                f"from convert_memory import write_checkpoint; write_checkpoint(__import__('pathlib').Path("
                f"{str(work / 'hf')!r}), {args.layers}, {args.hidden}, {args.intermediate}, {args.vocab})")
    size = (work / "hf" / "model.safetensors").stat().st_size
    base, _ = peak_rss_of("import jax, jax.numpy as jnp; jnp.zeros(1).block_until_ready()")
    load, t_load = peak_rss_of(f"from dflash_jax import load_target; load_target({str(work / 'hf')!r})")
    conv, t_conv = peak_rss_of(
        f"from dflash_jax.convert import main; main(['--hf', {str(work / 'hf')!r}, '--out', {str(work / 'out')!r}, '--quiet'])")
    cload, t_cload = peak_rss_of(f"from dflash_jax import load_target; load_target({str(work / 'out')!r})")
    on_mesh = (f"from dflash_jax import load_target; from dflash_jax.sharding import make_mesh; "
               f"import jax; p = load_target(%r, mesh=make_mesh({args.mesh!r}))[1]; jax.block_until_ready(p)")
    mload, t_mload = peak_rss_of(on_mesh % str(work / "hf"), args.devices)
    mcload, t_mcload = peak_rss_of(on_mesh % str(work / "out"), args.devices)
    base8, _ = peak_rss_of("import jax, jax.numpy as jnp; jnp.zeros(1).block_until_ready()", args.devices)
    gb = 1e9
    print(f"checkpoint: {size / gb:.2f} GB float32 safetensors ({args.layers} layers)")
    print(f"bare `import jax` peak RSS: {base / gb:.2f} GB")
    for name, rss, t, b in (("load HF dir", load, t_load, base), ("convert", conv, t_conv, base),
                            ("load converted", cload, t_cload, base),
                            (f"load HF dir, {args.devices} devices, {args.mesh}", mload, t_mload, base8),
                            (f"load converted, {args.devices} devices, {args.mesh}", mcload, t_mcload, base8)):
        print(f"{name:42s} peak RSS {rss / gb:.2f} GB = {rss / size:.2f} x checkpoint; "
              f"above bare jax {(rss - b) / size:.2f} x; {t:.1f}s")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
