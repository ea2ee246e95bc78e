"""The publication's hashing threads yield the CPU to the transfer (Linux nice, per thread).

    python -m pytest tests/unit/test_publish_priority.py -q
"""

import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from megatron_rl.publish.wire import HASH_THREAD_NICE, _yield_to_transfer

pytestmark = [pytest.mark.unit, pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux nice")]


def _nice_of_this_thread() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_hash_threads_run_below_the_caller_and_the_caller_keeps_its_priority():
    before = _nice_of_this_thread()
    with ThreadPoolExecutor(max_workers=1, initializer=_yield_to_transfer) as pool:
        hashing = pool.submit(_nice_of_this_thread).result()
    assert hashing == min(19, before + HASH_THREAD_NICE)
    assert _nice_of_this_thread() == before  # only the helper thread changed
