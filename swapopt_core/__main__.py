"""``python -m swapopt_core``: the same command line as the ``swapopt`` script."""

import sys

from swapopt_core._cli.main import main

if __name__ == "__main__":
    sys.exit(main())
