"""``python -m flowlift``: the same command line as ``flowlift``."""

import sys

from flowlift.commands.cli import main

if __name__ == "__main__":
    sys.exit(main())
