import os
import signal
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def pytest_configure(config):
    # A suite started in the background of a non-interactive shell (`make test &`, nohup, some CI
    # runners) inherits SIGINT ignored, and exec keeps it ignored in every child: the tests that
    # interrupt a child process (Ctrl-C cleanup) would wait for a signal that never arrives.
    # Handled (not ignored) here, children start with the default, as from a terminal.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    config.addinivalue_line("markers", "slow: long runs (minutes); excluded from `make test`")
    config.addinivalue_line("markers", "aio: needs DeepSpeed's aio op (libaio-dev and a JIT build)")
    config.addinivalue_line("markers", "cuda: needs a CUDA device")


@pytest.fixture
def offload_dir(tmp_path):
    """A real directory on the same filesystem as the tests (O_DIRECT capable on ext4)."""
    d = tmp_path / "ssd"
    d.mkdir()
    return d


@pytest.fixture
def exact():
    """An exactness oracle (tests/exactness.py) around the test: every tensor an offloader
    packs is compared with what its unpack returned, bit for bit; at the end, no mismatch and
    at least one offloaded tensor compared (use it in tests that claim offload is exact)."""
    from tests.exactness import ExactnessOracle

    with ExactnessOracle() as oracle:
        yield oracle
    oracle.assert_exact()
