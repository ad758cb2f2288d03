"""The persistent compilation cache the command-line tools turn on (`dflash_jax.compiling`), and
the warm-up's progress: a restart loads its programs instead of compiling them again."""

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# A small program under CompileProgress, as a warm-up compiles: prints the directory in use and
# the progress's closing line.
SCRIPT = """
import jax, jax.numpy as jnp
from dflash_jax.compiling import CompileProgress, enable_compile_cache
print("cache", enable_compile_cache())
with CompileProgress("compiling", quiet=True) as p:
    for n in (8, 16):
        jax.jit(lambda x: jnp.tanh(x) @ x.T + 1)(jnp.ones((n, n))).block_until_ready()
print(p.summary())
"""


def run(env_extra: dict, tmp_path: Path) -> list[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE",
                                                                     "DFLASH_COMPILE_CACHE"))}
    env.update(XDG_CACHE_HOME=str(tmp_path / "xdg"), JAX_PLATFORMS="cpu", **env_extra)
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def test_the_cache_is_on_by_default_and_a_restart_loads_every_program(tmp_path):
    first = run({}, tmp_path)
    assert first[0] == f"cache {tmp_path / 'xdg' / 'dflash-jax' / 'jax'}"
    n, cached = map(int, re.search(r": (\d+) programs, (\d+) loaded from the cache", first[1]).groups())
    assert n >= 2 and cached == 0, first  # the two programs, and the arrays' own small ones
    again = run({}, tmp_path)
    assert again[1].endswith(f": {n} programs, {n} loaded from the cache"), again


def test_the_cache_can_be_moved_or_turned_off_and_jax_s_own_setting_wins(tmp_path):
    assert run({"DFLASH_COMPILE_CACHE": str(tmp_path / "mine")}, tmp_path)[0] == f"cache {tmp_path / 'mine'}"
    assert (tmp_path / "mine").is_dir() and any((tmp_path / "mine").iterdir())
    off = run({"DFLASH_COMPILE_CACHE": "off"}, tmp_path)
    assert off[0] == "cache None" and off[1].endswith("0 loaded from the cache")
    own = run({"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax-own"), "DFLASH_COMPILE_CACHE": "off"}, tmp_path)
    assert own[0] == f"cache {tmp_path / 'jax-own'}"
