import os

# Tests run on the CPU; multi-device tests set their own XLA_FLAGS in subprocesses.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# The tiny models compile for far longer than they run, and LLVM's optimisation of the CPU code
# is most of a compile: at level 0 the suite takes about a third less time. The CPU's fusion
# emitters (MLIR, XLA's default) take about twice as long to compile the tests' thousands of small
# programs as the older loop emitters: without them tests/test_tree.py ran in 75 s instead of 114 s
# (2026-12-08). Every run of a test compiles the same way, so comparisons between engines are
# unaffected; the subprocesses the CLI tests start inherit the flags. DFLASH_TEST_XLA_OPT=1 keeps
# XLA's defaults.
_FAST_COMPILE = {"xla_backend_optimization_level": "0", "xla_cpu_use_fusion_emitters": "false"}
if os.environ.get("DFLASH_TEST_XLA_OPT") != "1":
    _flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = " ".join([_flags] + [f"--{k}={v}" for k, v in _FAST_COMPILE.items()
                                                   if k not in _flags]).strip()

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


def _mapped_regions():
    """How many memory regions this process has mapped (0 where /proc is not there)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def _region_limit():
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 65530  # Linux's default


# The CPU client maps every compiled program's code in several regions and keeps them while the
# program is cached. One worker compiles thousands of programs over the suite; at the kernel's
# limit on mapped regions (vm.max_map_count) the next mmap fails and XLA crashes with a
# segmentation fault, as the heavy tests/test_spec_decode.py did on a fresh cache (65530 regions
# after 30 of its tests). Past half the limit, the test that ends drops jax's compiled programs.
_REGION_BUDGET = _region_limit() // 2


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Drop jax's compiled programs after each test file, so that one file's programs do not
    add to the next's."""
    yield
    import jax

    jax.clear_caches()


@pytest.fixture(autouse=True)
def _bound_mapped_regions():
    """Within a file, drop jax's compiled programs once the process maps more than half the
    regions the kernel allows (see _REGION_BUDGET)."""
    yield
    if _mapped_regions() > _REGION_BUDGET:
        import jax

        jax.clear_caches()


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: a worker per core, at most 4 (each holds a few GB of compiled programs and
    models; the suite's files do not balance across more)."""
    return max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


def pytest_addoption(parser):
    parser.addoption("--soak-minutes", type=float, default=2.0,
                     help="how long tests/test_soak.py's mixed traffic runs (default 2, as in CI)")


# Under -n, each worker takes whole test files in collection order (`--dist loadfile`), the next
# one as it finishes. A suite that ends on one worker running a long file while the others wait is
# as long as that file's start plus the file: so the slowest files (by CI's --durations) go first,
# and the short ones fill in at the end. Within a file the order is unchanged.
SLOW_FILES_FIRST = ("test_scale.py", "test_no_hang.py", "test_soak.py", "test_spec_decode.py", "test_infer_cli.py", "test_tree.py",
                    "test_training.py", "test_serve.py", "test_bench.py", "test_demo.py", "test_qwen3_next.py",
                    "test_streaming.py", "test_page_pool.py", "test_hybrid.py", "test_aot.py", "test_dflash2.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # a stable sort: each file stays whole
