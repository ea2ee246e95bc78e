"""A streaming rollout worker's shutdown prints no traceback (issue 44, item 7): vLLM's output handler stops
before the engine core goes (rollout/engine_close.py).

    python -m pytest tests/unit/test_engine_close.py -q

`FakeAsyncLLM` keeps the order of vLLM's AsyncLLM.shutdown called from another thread than the engine's
loop: the engine core stops, the cancelled output reader hands the output handler an EngineDeadError, and
only then is the handler cancelled; a handler that gets the error first logs it with its traceback, as
vLLM's does ("AsyncLLM output_handler failed.").  On the real engine: tests/e2e/test_streaming.py
::test_a_normal_run_prints_no_traceback.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from types import SimpleNamespace

import pytest

from megatron_rl.rollout.stream_actor import StreamRolloutWorker
from megatron_rl.rollout.stream_engine import StreamEngine

pytestmark = pytest.mark.unit


class EngineDeadError(RuntimeError):
    pass


class FakeAsyncLLM:
    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.output_handler, self.aborted, self.down = loop, None, [], False

    async def start(self) -> None:
        self.outputs: asyncio.Queue = asyncio.Queue()
        self.output_handler = asyncio.create_task(self._handle())

    async def _handle(self) -> None:
        try:
            while True:
                item = await self.outputs.get()
                if isinstance(item, Exception):
                    raise item
        except Exception:
            logging.getLogger("vllm.v1.engine.async_llm").exception("AsyncLLM output_handler failed.")

    async def abort(self, request_ids) -> None:
        self.aborted.extend(request_ids)

    def shutdown(self) -> None:
        self.down = True
        self.loop.call_soon_threadsafe(self.outputs.put_nowait, EngineDeadError("EngineCore encountered an issue"))
        time.sleep(0.2)  # the loop runs meanwhile, as it does while vLLM tears its client down
        handler = self.output_handler
        if handler is not None and not handler.done():
            self.loop.call_soon_threadsafe(handler.cancel)


def worker_on(engine: FakeAsyncLLM, loop) -> StreamRolloutWorker:
    """A StreamRolloutWorker around `engine` without vLLM (only what shutdown touches)."""
    worker = StreamRolloutWorker.__new__(StreamRolloutWorker)
    worker._loop = loop
    worker.stream = StreamEngine(engine, 0)
    return worker


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.close()


def test_a_normal_shutdown_logs_no_output_handler_traceback(loop, caplog):
    engine = FakeAsyncLLM(loop)
    asyncio.run_coroutine_threadsafe(engine.start(), loop).result(5)
    worker = worker_on(engine, loop)
    worker.stream._flights["r1"] = SimpleNamespace(result=SimpleNamespace(response_tokens=[7]))  # still in flight
    with caplog.at_level(logging.ERROR):
        worker.shutdown()
        time.sleep(0.3)  # anything the loop still had to say
    assert engine.down and worker.stream is None
    assert engine.aborted == ["r1"]  # its caller gets vLLM's "abort" result instead of waiting for ever
    failed = [r for r in caplog.records if "output_handler failed" in r.getMessage() or r.exc_info]
    assert not failed, [r.getMessage() for r in failed]

