"""``python -m ssdtrain_megatron.tools ...``: the ``ssdtrain`` command without its entry point."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
