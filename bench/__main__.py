import sys

from infer.bench.cli import main

sys.exit(main())
