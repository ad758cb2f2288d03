import sys

try:
    from bench.cli import main
except ImportError:
    sys.exit("error: the benchmarks run from a clone of the repository (its bench/ folder): "
             "cd to the clone and run python -m bench")

sys.exit(main())
