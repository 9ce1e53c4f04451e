"""``python -m dptune.cli``: the same as ``dptune``."""

import sys

from dptune.cli.app import main

sys.exit(main())
