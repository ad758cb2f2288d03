"""A run never waits forever.

- The engine's programs (prefill and the cycle loop, for every family, greedy and sampled; the
  training target's taps) call no library routine: two LAPACK triangular solves running as
  concurrent thunks deadlocked XLA's CPU thread pool on two cores (a hybrid target's chunked
  delta rule; now elementwise products only). Compiled, the hybrid engine holds only XLA's own
  sequential TopK.
- The watchdog ends a stalled wait with a one-line error and exit status 3, from the CLI
  too, keeping the rows already written; a short wait never trips it.
- Stress (`-m heavy`): the hybrid DFlash engine at a width where the old solve deadlocked
  (32 rows x 16 value heads) runs 20 times in fresh processes, each to completion.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.engine import Sampling, prefill, rows_of, run_cycles
from dflash_jax.engine.watchdog import STALL_EXIT_CODE, Watchdog
from dflash_jax.model import delta_rule
from dflash_jax.training import target_features
from fixtures import tiny
from fixtures import GREEDY_CASES, engine, setup

REPO = Path(__file__).resolve().parent.parent

def custom_calls(text: str) -> set[str]:
    """Custom-call targets of a lowered (StableHLO) or compiled (HLO) program's text."""
    return set(re.findall(r"stablehlo\.custom_call @([\w.$]+)", text)) | set(
        re.findall(r'custom_call_target="([^"]+)"', text))


def engine_programs(gen):
    """The lowered cycle loop and one-row prefill of a BatchEngine (the shapes its own runs use)."""
    state = gen.new_state()
    loop = run_cycles.lower(gen.tparams, gen.dparams, gen.spec, state, gen.stop_ids, np.int32(1), np.bool_(False))
    one = lambda dtype: jnp.ones((1,), dtype)
    admit = prefill.lower(gen.tparams, gen.dparams, gen.spec, state, jnp.ones((1, 16), jnp.int32), one(jnp.int32),
                          jnp.zeros((1,), jnp.int32), one(jnp.uint32), np.int32(0), one(jnp.int32), gen.stop_ids,
                          jax.tree.map(jnp.asarray, rows_of([gen.spec.sampling])))
    return {"run_cycles": loop, "prefill": admit}


# one engine per family, at the shapes its first greedy test compiles anyway
FAMILY_ENGINES: dict[str, tuple] = {}
for case in GREEDY_CASES:
    case = getattr(case, "values", case)
    FAMILY_ENGINES.setdefault(case[0].split("-")[0], case)


# everyday: the dense, MoE and hybrid families (the solve was a hybrid's); the rest under -m heavy
HEAVY_FAMILIES = ("gemma4", "gpt_oss", "qwen3_5_moe")


@pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.heavy) if f in HEAVY_FAMILIES else f
                                    for f in sorted(FAMILY_ENGINES)])
def test_engine_programs_call_no_library_routine(family):
    """As jax lowers them, the programs hold no custom call at all (a LAPACK solve was one)."""
    name, block_size, batch_size = FAMILY_ENGINES[family]
    for what, lowered in engine_programs(engine(name, block_size, batch_size)).items():
        assert custom_calls(lowered.as_text()) == set(), f"{family} {what}"


def test_compiled_hybrid_engine_calls_no_self_parallel_routine():
    """XLA's CPU compiler adds calls of its own: in the compiled hybrid engine (the programs the
    deadlock was in) only its TopK may appear, a sequential loop over rows with no thread pool."""
    name, block_size, batch_size = FAMILY_ENGINES["qwen3_5"]
    for what, lowered in engine_programs(engine(name, block_size, batch_size)).items():
        assert custom_calls(lowered.compile().as_text()) <= {"TopK"}, what


def test_sampling_and_training_programs_call_no_library_routine():
    """top-k / top-p sampling (sorts), and a hybrid target's taps for training (the chunked
    rule over whole sequences)."""
    name, block_size, batch_size = FAMILY_ENGINES["qwen3"]
    sampled = engine(name, block_size, batch_size, sampling=Sampling(temperature=0.7, top_k=3, top_p=0.9))
    for what, lowered in engine_programs(sampled).items():
        assert custom_calls(lowered.as_text()) == set(), f"sampling {what}"
    target, tparams, _, _ = setup("qwen3_5-v8")
    taps = jax.jit(target_features, static_argnums=(1, 3)).lower(tparams, target, jnp.zeros((2, 80), jnp.int32), (0, 2))
    assert custom_calls(taps.as_text()) == set()


def test_the_chunked_rule_is_matmuls_only():
    """The program that used to hold the LAPACK solve, alone: prefill-sized (two chunks of 64)
    and verify-sized (one chunk of 16)."""
    for t in (128, 16):
        q = k = jnp.ones((2, t, 2, 8))
        v = jnp.ones((2, t, 4, 8))
        g = beta = jnp.ones((2, t, 4))
        lowered = jax.jit(delta_rule.chunked).lower(q, k, v, -g, beta * 0.5, jnp.zeros((2, 4, 8, 8)))
        assert custom_calls(lowered.as_text()) == set()
        assert custom_calls(lowered.compile().as_text()) == set()


# --------------------------------------------------------------------------- the watchdog


def test_watchdog_reports_only_a_wait_longer_than_its_timeout():
    stalls = []
    dog = Watchdog(0.3, on_stall=stalls.append)
    for _ in range(3):
        with dog.waiting("a short wait"):
            time.sleep(0.05)
    time.sleep(0.5)  # idle, outside any wait: nothing to report
    assert stalls == []
    with dog.waiting("a long wait"):
        time.sleep(1.0)
    assert len(stalls) == 1 and "no progress for 0.3 s while a long wait" in stalls[0]
    with dog.waiting("a short wait"):
        time.sleep(0.05)
    time.sleep(0.4)
    assert len(stalls) == 1
    with pytest.raises(ValueError, match="timeout"):
        Watchdog(0)


def run_python(code: str, timeout: float = 240):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env=env)
    return proc, time.monotonic() - start


def test_a_stalled_wait_ends_the_process_with_one_line_and_status_3():
    proc, seconds = run_python("""
        import time
        from dflash_jax.engine.watchdog import Watchdog
        dog = Watchdog(0.5)
        with dog.waiting("a short wait"):
            time.sleep(0.1)
        print("short wait done", flush=True)
        with dog.waiting("sleeping forever"):
            time.sleep(600)
        print("not reached")
    """, timeout=120)
    assert proc.returncode == STALL_EXIT_CODE, proc.stderr
    assert proc.stdout.splitlines() == ["short wait done"]
    assert proc.stderr.strip().count("\n") == 0 and "no progress for 0.5 s while sleeping forever" in proc.stderr
    assert seconds < 60


def test_infer_cli_stall_exits_3_naming_it_and_keeps_finished_rows(tmp_path):
    """The device is made to stall (every wait after the first row is written blocks for
    good): `python -m infer --stall-timeout` ends the run with the one-line error and exit
    status 3, and the row written before the stall is in --output."""
    out = tmp_path / "out.jsonl"
    proc, _ = run_python(f"""
        import sys, time
        import dflash_jax.engine.scheduler as scheduler
        import dflash_jax.generation as generation
        real_to_host, real_write = scheduler.to_host, generation.JsonlWriter.write
        written = []
        def to_host(x):
            if written:
                time.sleep(600)  # a device that never answers
            return real_to_host(x)
        def write(self, *a, **kw):
            written.append(1)
            return real_write(self, *a, **kw)
        scheduler.to_host, generation.JsonlWriter.write = to_host, write
        from infer.cli import main
        sys.exit(main(["--target", {str(tiny() / "target")!r},
                       "--input", {str(tiny() / 'prompts.jsonl')!r}, "--output", {str(out)!r},
                       "--max-new-tokens", "8", "--batch-size", "1", "--quiet", "--stall-timeout", "0.02"]))
    """)
    assert proc.returncode == STALL_EXIT_CODE, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: the device made no progress for 1.2 s while"), last
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 1 and len(rows[0]["output_ids"]) == 8


def test_stall_timeout_flag_is_checked(capsys):
    from infer.cli import main

    assert main(["--target", str(tiny() / "target"), "--input", "x.jsonl", "--stall-timeout", "-1"]) == 2
    assert "--stall-timeout must be >= 0" in capsys.readouterr().err


# --------------------------------------------------------------------------- stress


def wide_hybrid_pair(root: Path) -> tuple[Path, Path, Path]:
    """A tiny Qwen3.5 target with 16 value heads per linear layer, a random block-16 drafter,
    and 32 prompts of one bucket: at batch 32 its delta-rule systems (32 rows x 16 heads)
    were wide enough for the LAPACK solve to split over the thread pool, and deadlock."""
    from tiny import make_model, save_model, write_random_drafter

    target = save_model(make_model("qwen3_5", seed=5, linear_num_key_heads=4, linear_num_value_heads=16),
                        root / "target")
    drafter = write_random_drafter(target, root / "drafter", block_size=16, taps=(0, 2), layers=2)
    rs = np.random.RandomState(0)
    rows = root / "rows.jsonl"
    rows.write_text("".join(json.dumps({"input_ids": rs.randint(0, 159, int(rs.randint(4, 16))).tolist()}) + "\n"
                            for _ in range(32)))
    return target, drafter, rows


RUNS = 3


@pytest.mark.heavy
def test_hybrid_dflash_runs_three_times_without_hanging(tmp_path):
    """Fresh processes at the width where the old LAPACK solve deadlocked XLA's CPU pool: each
    finishes. Three runs (.ci/run's time budget): the everyday tests above already prove no
    engine program calls such a routine; these runs are the end-to-end smoke."""
    target, drafter, rows = wide_hybrid_pair(tmp_path)
    seconds = []
    for run in range(RUNS):
        out = tmp_path / f"out{run}.jsonl"
        cmd = [sys.executable, "-m", "infer", "--target", str(target), "--drafter", str(drafter), "--input",
               str(rows), "--output", str(out), "--batch-size", "32", "--max-new-tokens", "24", "--dtype",
               "float32", "--ignore-eos", "--quiet", "--stall-timeout", "2"]
        start = time.monotonic()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
        except subprocess.TimeoutExpired:
            pytest.fail(f"run {run + 1} hung (killed after 300 s; earlier runs took {seconds})")
        seconds.append(round(time.monotonic() - start, 1))
        assert proc.returncode == 0, f"run {run + 1}: {proc.stderr[-2000:]}"
        assert len(out.read_text().splitlines()) == 32
    print(f"{RUNS} runs, each finished; longest {max(seconds)} s, all: {seconds}")
