import os

# Tests run on the CPU; multi-device tests set their own XLA_FLAGS in subprocesses.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
