import sys

from instrument.cli import main

sys.exit(main())
