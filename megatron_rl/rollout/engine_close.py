"""The orderly end of a streaming rollout engine: vLLM's output handler stops before the engine core does.

    worker._run(quiesce(stream))    # on the engine's event loop: requests in flight aborted, handler stopped
    stream.shutdown()               # then the engine core process goes (StreamEngine.shutdown)

vLLM's AsyncLLM.shutdown, called from another thread than the engine's loop (a StreamRolloutWorker's
method thread), stops the engine core process, then asks the loop to cancel the client's output reader
and, in a second callback, the output handler.  The loop can run between the two: the reader, cancelled,
hands the handler an EngineDeadError, which the handler logs with its traceback ("AsyncLLM output_handler
failed"): an ERROR and a traceback from the rollout worker at the end of a normal run, which the console
shows.  So the handler is cancelled first, on the loop, and awaited; requests still in flight are aborted
before (their callers get an "abort" result, what vLLM's own shutdown gives them), so none waits for
outputs nobody reads any more.  An engine that died earlier (its handler finished) is left as it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

log = logging.getLogger(__name__)


async def quiesce(stream) -> None:
    """Abort what `stream` (a StreamEngine) has in flight and stop its engine's output handler."""
    engine = stream.engine
    if engine is None:
        return
    in_flight = list(stream.in_flight())
    if in_flight:
        try:
            await engine.abort(in_flight)
        except Exception as err:  # noqa: BLE001 -- the engine goes anyway; its callers then fail with it
            log.warning("aborting %d request(s) at shutdown: %s", len(in_flight), err)
    handler = getattr(engine, "output_handler", None)  # vLLM's task reading the engine core's outputs
    if handler is None or handler.done():
        return
    handler.cancel()  # AsyncLLM.shutdown then finds it done and leaves it
    with contextlib.suppress(asyncio.CancelledError):
        await handler
