import os

# Tests run on the CPU; multi-device tests set their own XLA_FLAGS in subprocesses.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# The tiny models compile for far longer than they run, and LLVM's optimisation of the CPU code
# is most of a compile: at level 0 the suite takes about a third less time. Every run of a test
# compiles the same way, so comparisons between engines are unaffected; the subprocesses the CLI
# tests start inherit it. DFLASH_TEST_XLA_OPT=1 keeps XLA's default.
if os.environ.get("DFLASH_TEST_XLA_OPT") != "1" and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()

# Compiling is most of the suite's time. jax's persistent compilation cache keeps every compiled
# program on disk (in .jax_cache/, ignored by git; the CLI and training subprocesses inherit it):
# a program compiled by several tests, or by an earlier run, is loaded instead of compiled again.
# DFLASH_TEST_COMPILE_CACHE=off compiles everything afresh; a path puts the cache there.
_cache = os.environ.get("DFLASH_TEST_COMPILE_CACHE", os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), ".jax_cache"))
if _cache != "off":
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _cache)
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")



def pytest_runtest_logstart(nodeid, location):
    """Under -q pytest prints bare dots; name each test file as it starts, so a long compile
    does not look like a hang."""
    path = location[0]
    config = _state["config"]
    reporter = config.pluginmanager.get_plugin("terminalreporter") if config else None
    parallel = config is not None and getattr(config.option, "numprocesses", None)  # xdist shows its own progress
    if path != _state["file"] and reporter is not None and reporter.verbosity < 0 and not parallel:
        _state["file"] = path
        reporter.write(f"\n{path} ")


_state = {"file": None, "config": None}


def pytest_configure(config):
    _state["config"] = config


import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Drop jax's compiled programs after each test file. One process compiles thousands of them
    over the suite, and the CPU client keeps every one mapped: without this the suite ran into a
    segmentation fault inside XLA's compiler deep into the run."""
    yield
    import jax

    jax.clear_caches()


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: a worker per core, at most 4 (each holds a few GB of compiled programs and
    models; the suite's files do not balance across more)."""
    return max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))
