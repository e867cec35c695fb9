import sys

from instrument.cli import entry

sys.exit(entry())
