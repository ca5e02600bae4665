"""``python -m specdecode.cli`` (as ``torchrun ... -m specdecode.cli``): the command line."""

import sys

from specdecode.cli.main import main

sys.exit(main())
