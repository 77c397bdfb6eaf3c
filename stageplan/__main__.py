"""python -m stageplan -> stageplan.cli.main."""

import sys

from stageplan.cli import main

sys.exit(main())
