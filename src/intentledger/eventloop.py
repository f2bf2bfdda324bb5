"""Running a long-lived process's coroutine on uvloop where there is one.

uvloop's event loop is written in C; asyncio's own is pure Python and was
about a sixth of a worker's CPU (docs/benchmarks.md). uvicorn already picks
uvloop for the API; workers ask for it here. Without uvloop (Windows) the
standard loop runs the same code. Servers and workers alike declare their loop
thread to sniffio (below).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import sniffio

T = TypeVar("T")


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


@contextmanager
def declared_asyncio_thread() -> Iterator[None]:
    """Tell sniffio that this thread runs an asyncio loop, as its docs ask loops to.

    anyio (under httpx and Starlette) asks sniffio which library is running on
    nearly every call; undeclared, sniffio finds out by looking up the current
    task each time, which was about a twentieth of a worker's CPU.
    """
    previous = sniffio.thread_local.name
    sniffio.thread_local.name = "asyncio"
    try:
        yield
    finally:
        sniffio.thread_local.name = previous


def serve(app: Any, **options: Any) -> None:
    """`uvicorn.run` (which runs its loop in this thread), with the thread declared."""
    import uvicorn

    with declared_asyncio_thread():
        uvicorn.run(app, **options)


def run(main: Coroutine[Any, Any, T]) -> T:
    with declared_asyncio_thread(), asyncio.Runner(loop_factory=_loop_factory()) as runner:
        return runner.run(main)
