"""``python -m joules``: the ``joules`` command line."""

import sys

from joules.cli import main

if __name__ == "__main__":
    sys.exit(main())
