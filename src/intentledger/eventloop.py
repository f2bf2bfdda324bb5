"""Running a long-lived process's coroutine on uvloop where there is one.

uvloop's event loop is written in C; asyncio's own is pure Python and was
about a sixth of a worker's CPU (docs/benchmarks.md). uvicorn already picks
uvloop for the API; workers ask for it here. Without uvloop (Windows) the
standard loop runs the same code.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def run(main: Coroutine[Any, Any, T]) -> T:
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        return runner.run(main)
