"""Moved to :mod:`dptune.backends.simulated.ddp`; this name keeps old imports working."""

from dptune.backends.simulated.ddp import *  # noqa: F401,F403
from dptune.backends.simulated.ddp import __all__  # noqa: F401
