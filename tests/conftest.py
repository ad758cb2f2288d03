import os

# Tests run on the CPU; multi-device tests set their own XLA_FLAGS in subprocesses.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")



def pytest_runtest_logstart(nodeid, location):
    """Under -q pytest prints bare dots; name each test file as it starts, so a long compile
    does not look like a hang."""
    path = location[0]
    reporter = _state["config"].pluginmanager.get_plugin("terminalreporter") if _state["config"] else None
    if path != _state["file"] and reporter is not None and reporter.verbosity < 0:
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
