import sys

from elasticdl_strategy.cli import main

sys.exit(main())
