"""`python -m train`: see train/cli.py."""

import sys

from train.cli import main

sys.exit(main())
