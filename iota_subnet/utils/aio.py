"""Small asyncio helpers shared by the neurons."""
from __future__ import annotations

import asyncio
import contextlib
from typing import Awaitable, TypeVar

T = TypeVar("T")


class StopRequested(Exception):
    """A stop (SIGTERM / SIGINT) was requested while an awaited step was still running."""


async def until_stopped(aw: Awaitable[T], stop: asyncio.Event) -> T:
    """Await ``aw`` unless ``stop`` is set first: then cancel it and raise :class:`StopRequested`."""
    task = asyncio.ensure_future(aw)
    if stop.is_set():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        raise StopRequested("stop requested")
    waiter = asyncio.ensure_future(stop.wait())
    try:
        done, _ = await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        waiter.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    raise StopRequested("stop requested")
