import sys

from dptune.cli import main

sys.exit(main())
