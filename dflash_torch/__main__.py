"""``python -m dflash_torch``: the ``dflash-torch`` command line."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
