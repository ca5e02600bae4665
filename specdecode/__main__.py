"""``python -m specdecode``: the command line."""

import sys

from specdecode.cli.main import main

sys.exit(main())
