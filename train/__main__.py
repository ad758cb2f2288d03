import sys

from train.trainer import main

sys.exit(main())
