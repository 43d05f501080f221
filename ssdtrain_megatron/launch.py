"""``python -m ssdtrain_megatron.launch SCRIPT [args] [--ssd-offload ...]``: run a Megatron
training script (e.g. Megatron-LM's pretrain_gpt.py) with SSD activation offload, unmodified.

See :mod:`ssdtrain_megatron.megatron.launch`; this module is its short name.
"""

import sys

from .megatron.launch import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
