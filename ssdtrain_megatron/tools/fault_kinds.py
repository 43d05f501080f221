"""The fault kinds of ``ssdtrain soak`` (tools/faults.py injects them), without importing torch:
the command's parser lists them in ``ssdtrain --help``."""

KINDS = ("write_eio", "write_enospc", "short_write", "read_eio", "short_read", "latency_spike",
         "stall")
"""IO errors of a write (EIO, ENOSPC, half written) or a read (EIO, half read), a call 100x
slower than usual, an IO thread held past io_timeout_s."""

OP_OF = {"write_eio": "write", "write_enospc": "write", "short_write": "write",
         "read_eio": "read", "short_read": "read"}
"""The op an IO-error kind applies to (spikes and stalls apply to both)."""
