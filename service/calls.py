"""How a handler on the event loop runs its blocking work on threads.

Every RPC handler is a coroutine on the grpc.aio server's event loop (one execution
model: docs/architecture.md, "Execution"). What blocks (decoding, searching, assembling,
encoding, building an index) runs on the loop's thread pool, never on the loop:

- :func:`in_thread` runs one function there and returns its value;
- :func:`produced` runs a blocking iterator there, up to ``depth`` items ahead of the
  handler that sends them, so the next slice of a streamed answer is made while this
  one goes out;
- :class:`RequestFeed` hands the messages of a streamed request, read on the loop, to a
  blocking iterator on a thread, one as it asks for it.

The blocking work learns of its call only through a :class:`CallScope`: whether the call
is still wanted (False once the client left, its deadline passed or the handler
stopped) and the seconds left to its deadline. A handler that is cancelled waits for its
thread to let go, so that the call keeps its admission slot while its work runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from typing import Any, TypeVar

import grpc

T = TypeVar("T")

#: A deadline further away than this is no deadline (gRPC reports "none" as ~forever).
_NO_DEADLINE_S = 86_400 * 365


class CallScope:
    """What blocking work on a thread may know of its call."""

    __slots__ = ("_deadline", "_over")

    def __init__(self, context: grpc.aio.ServicerContext) -> None:
        left = context.time_remaining()
        self._deadline = None if left is None or left > _NO_DEADLINE_S else time.monotonic() + left
        self._over = threading.Event()

    def is_active(self) -> bool:
        """False once the call ended under its work (cancelled, past its deadline)."""
        return not self._over.is_set()

    def time_left_s(self) -> float | None:
        """Seconds to the call's deadline (0 once passed); None without a deadline."""
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def end(self) -> None:
        """The call is over: work checking ``is_active`` stops."""
        self._over.set()


async def in_thread(scope: CallScope, function: Callable[..., T], *args: Any) -> T:
    """``function(*args)`` on the loop's thread pool.

    When the call is cancelled meanwhile, its work is told (``scope.is_active()`` turns
    False) and the call waits for the thread to let go before it ends.
    """
    running = asyncio.get_running_loop().run_in_executor(None, function, *args)
    try:
        return await asyncio.shield(running)
    except asyncio.CancelledError:
        scope.end()
        # Not BaseException: a GeneratorExit (the loop closing this coroutine at
        # shutdown) must end it, not be swallowed here.
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await running
        raise


_DONE = object()


class _Failed:
    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


async def produced(
    scope: CallScope, items: Callable[[], Iterator[T]], depth: int = 1
) -> AsyncGenerator[T, None]:
    """The items of ``items()``, made on a thread up to ``depth`` ahead of the caller.

    An exception of the iterator is raised here, at the item where it happened. When the
    caller stops early (or is cancelled), the scope ends, the thread stops after the item
    it is making and closes the iterator, and this generator returns once it has.
    """
    loop = asyncio.get_running_loop()
    ready: asyncio.Queue[object] = asyncio.Queue()
    room = threading.Semaphore(depth)

    def hand_over(value: object) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits
            loop.call_soon_threadsafe(ready.put_nowait, value)

    def work() -> None:
        made: Iterator[T] | None = None
        try:
            made = items()
            for item in made:
                room.acquire()
                if not scope.is_active():
                    return
                hand_over(item)
            hand_over(_DONE)
        except BaseException as exc:  # raised in the caller
            hand_over(_Failed(exc))
        finally:
            close = getattr(made, "close", None)
            if close is not None:
                close()

    worker = loop.run_in_executor(None, work)
    try:
        while True:
            value = await ready.get()
            if value is _DONE:
                return
            if isinstance(value, _Failed):
                raise value.error
            room.release()
            yield value  # type: ignore[misc]
    finally:
        if not worker.done():
            scope.end()
            for _ in range(depth + 1):
                room.release()  # wake a worker waiting for room
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.shield(worker)


class RequestFeed:
    """The messages of a streamed request, read on the loop, for a blocking iterator.

    ``messages()`` (on a thread) asks for each message when it needs it; the loop reads
    it (``pump``, a task of the handler) and hands it over. Reading only when asked keeps
    the request's flow control with gRPC: a client that sends faster than its answer is
    made waits in gRPC's window, not in server memory.
    """

    def __init__(self, requests: AsyncIterator[Any], scope: CallScope) -> None:
        self._requests = requests
        self._scope = scope
        self._asked = asyncio.Event()
        self._given: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._loop = asyncio.get_running_loop()

    async def pump(self) -> None:
        """Read a message each time one is asked for, until the stream ends."""
        try:
            while True:
                await self._asked.wait()
                self._asked.clear()
                message = await anext(self._requests, _DONE)
                self._given.put(message)
                if message is _DONE:
                    return
        except Exception as exc:  # the reader's failure is the iterator's
            self._given.put(_Failed(exc))

    def stop(self) -> None:
        """End the iterator on its thread (the call is over)."""
        self._given.put(_DONE)

    def messages(self) -> Iterator[Any]:
        """The request's messages, each read when asked for (call from a thread)."""
        while self._scope.is_active():
            self._loop.call_soon_threadsafe(self._asked.set)
            message = self._given.get()
            if message is _DONE:
                return
            if isinstance(message, _Failed):
                raise message.error
            yield message
