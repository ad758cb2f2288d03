"""Compiling: jax's persistent compilation cache, on by default for the command-line tools, and
the progress of a warm-up that compiles many programs.

An engine compiles one program per prompt bucket, admission width and loop (dozens, most of a
start-up). With the persistent cache every compiled program is kept on disk, keyed by the
program, its shapes, the jax version and the compiler flags, so a restart of the same
configuration loads them instead of compiling them again.

    DFLASH_COMPILE_CACHE=off   no persistent cache (unless jax's own JAX_COMPILATION_CACHE_DIR is set)
    DFLASH_COMPILE_CACHE=DIR   keep it in DIR
    (unset)                    $XDG_CACHE_HOME/dflash-jax/jax (~/.cache/dflash-jax/jax), at most 4 GiB,
                               least recently used entries dropped first

A cache directory set through jax itself (JAX_COMPILATION_CACHE_DIR, `jax.config`) is used as it is.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

DEFAULT_MAX_BYTES = 4 << 30


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dflash-jax" / "jax"


def enable_compile_cache(say=lambda *a: None) -> str | None:
    """Turn jax's persistent compilation cache on, where DFLASH_COMPILE_CACHE and jax's own
    settings allow (see the module's doc); call before the first compile. Returns the directory in
    use, or None."""
    import jax

    setting = os.environ.get("DFLASH_COMPILE_CACHE", "")
    current = jax.config.jax_compilation_cache_dir
    if current:  # set through jax: the user's (or the tests') own
        return current
    if setting.lower() in ("off", "0", "false", "no"):
        return None
    path = Path(setting).expanduser() if setting else default_cache_dir()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        say(f"warning: compilation cache off: cannot create {path} ({e.strerror}); set DFLASH_COMPILE_CACHE")
        return None
    jax.config.update("jax_compilation_cache_dir", str(path))
    # Every program: most of an engine's compile in a few hundred milliseconds each, and a
    # restart should compile none of them.
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    if "JAX_COMPILATION_CACHE_MAX_SIZE" not in os.environ and not setting:
        jax.config.update("jax_compilation_cache_max_size", DEFAULT_MAX_BYTES)
    return str(path)


def compiles(fn) -> int:
    """How many programs a jitted function holds: one per static shape (and, for a `PlatformJit`,
    platform) it has been traced for. Tests and benchmarks count compiles with it: a count that
    does not move across calls means nothing compiled.

    jax has no public count of a jit's programs; this is the one place that reads its private
    `_cache_size()` (a `PlatformJit` sums its jits' the same way)."""
    return fn._cache_size()


class _Counts:
    """Programs compiled and loaded from the persistent cache, process-wide (jax.monitoring's
    events; its listeners cannot be removed, so one pair is registered, once)."""

    lock = threading.Lock()
    compiled = 0  # every backend compile request, cache hits included
    from_cache = 0
    registered = False

    @classmethod
    def register(cls):
        with cls.lock:
            if cls.registered:
                return
            cls.registered = True
        import jax

        def on_duration(event: str, _secs: float, **_kw):
            if event == "/jax/core/compile/backend_compile_duration":
                with cls.lock:
                    cls.compiled += 1

        def on_event(event: str, **_kw):
            if event == "/jax/compilation_cache/cache_hits":
                with cls.lock:
                    cls.from_cache += 1

        jax.monitoring.register_event_duration_secs_listener(on_duration)
        jax.monitoring.register_event_listener(on_event)

    @classmethod
    def now(cls) -> tuple[int, int]:
        with cls.lock:
            return cls.compiled, cls.from_cache


def step_line(done: int, total: int, label: str = "") -> str:
    """What a warm-up is doing, as its log says it, given progress(done, total, label): `done` steps
    finished, the step `label` starting (the log's "compiling 5/14: prompts of 64 tokens x 1" is the
    5th step running, 4 done). After the last (done = total): "compiled 14/14"."""
    if done >= total:
        return f"compiled {total}/{total}"
    return f"compiling {done + 1}/{total}" + (f": {label}" if label else "")


class CompileProgress:
    """A progress bar over a warm-up's steps (`BatchEngine.warmup(progress=...)`), with the
    programs compiled so far and how many of them came from the persistent cache:

        with CompileProgress("compiling (block size 16, batch 8)") as p:
            gen.warmup(lengths, progress=p.step)

    ends with a line `compiled in 12.3s: 40 programs, 38 loaded from the cache` (on stderr, unless
    quiet; `summary()` gives it too)."""

    def __init__(self, desc: str, quiet: bool = False, file=None):
        self.desc, self.quiet, self.file = desc, quiet, file or sys.stderr
        self.bar = None
        self.label = ""

    def __enter__(self) -> "CompileProgress":
        _Counts.register()
        self.start_counts, self.t0 = _Counts.now(), time.perf_counter()
        if not self.quiet:
            print(f"{self.desc} ...", file=self.file, flush=True)
        return self

    def counts(self) -> tuple[int, int]:
        compiled, cached = _Counts.now()
        return compiled - self.start_counts[0], cached - self.start_counts[1]

    def step(self, done: int, total: int, label: str = ""):
        """Called before each step (done = the steps finished) and once after the last (done = total).
        On a terminal a bar; in a log a line per step."""
        if self.quiet:
            return
        compiled, cached = self.counts()
        programs = f"{compiled} programs ({cached} from the cache)"
        if not self.file.isatty():
            if done < total:
                print(f"  {step_line(done, total, label)} [{time.perf_counter() - self.t0:.0f}s, {programs} so far]",
                      file=self.file, flush=True)
            return
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc="compiling", unit="step", file=self.file, leave=False,
                            bar_format="{desc}: {n}/{total} steps [{elapsed}] {postfix}")
        self.bar.set_postfix_str(f"{programs}{', ' + label if label else ''}", refresh=False)
        self.bar.update(done - self.bar.n)

    def summary(self) -> str:
        compiled, cached = self.counts()
        return (f"compiled in {time.perf_counter() - self.t0:.1f}s: {compiled} programs, {cached} loaded from "
                f"the cache")

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.close()
        if not self.quiet and exc[0] is None:
            print(self.summary(), file=self.file, flush=True)
        return False
