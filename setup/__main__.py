"""`python -m setup`: from a fresh clone to a running Strata service (see setup/wizard.py for the steps)."""
import sys

from .wizard import run

sys.exit(run())
