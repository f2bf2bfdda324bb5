"""Running a long-lived process's coroutine on uvloop where there is one.

uvloop's event loop is written in C; asyncio's own is pure Python and was
about a sixth of a worker's CPU (docs/benchmarks.md). uvicorn already picks
uvloop for the API; workers ask for it here. Without uvloop (Windows) the
standard loop runs the same code. A standalone sandbox provider is the one
server on asyncio's loop (`EAGER_ACCEPT_LOOP`, below). Servers and workers
alike declare their loop thread to sniffio, freeze what exists at their
start out of the collector's walks and collect their youngest generation
less often (`freeze_what_starts_with_the_process`).
"""

from __future__ import annotations

import asyncio
import gc
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


# The loop of a server that must take on new connections promptly while busy
# (the sandbox provider; `serve(..., eager_accept=True)`): asyncio's own. uvloop's
# libuv (1.45 and later, libuv pull request 3696) accepts one connection per
# turn of the loop, so a sandbox answering hundreds of requests a turn took on
# new connections at a few a second, and a call on a connection opened in a
# burst waited over 10 s before its request was read: a timeout, an UNKNOWN the
# provider made, counted as ours (docs/benchmarks.md, step 46). asyncio's loop
# accepts every waiting connection, up to the backlog, in one turn.
EAGER_ACCEPT_LOOP = "asyncio"


def serve(app: Any, *, eager_accept: bool = False, **options: Any) -> None:
    """`uvicorn.run` (which runs its loop in this thread), with the thread declared;
    `eager_accept`: on `EAGER_ACCEPT_LOOP`, not uvloop."""
    import uvicorn

    if eager_accept:
        if "loop" in options:
            raise ValueError("eager_accept chooses the loop: pass one or the other")
        options["loop"] = EAGER_ACCEPT_LOOP
    with declared_asyncio_thread():
        uvicorn.run(app, **options)


# How many more container objects a process holds than it has freed, since
# the last collection, before its youngest generation is collected: CPython's
# default is 700.
YOUNG_GENERATION_THRESHOLD = 10_000


def freeze_what_starts_with_the_process() -> None:
    """Take what the process holds before its loop and its engines are built
    (modules, the libraries' tables, the settings) out of the cyclic
    collector's walks, for good, and collect the youngest generation less
    often.

    CPython 3.11's collector walks every object of its oldest generation on
    each full collection, and runs one once more than ten collections of the middle
    generation have passed and the objects promoted since the last full one
    reach a quarter of what that one kept. A worker's payments in flight
    outlive the younger collections by the thousand, so in a drain a full
    collection ran every second or so and walked the 165,000 objects of the
    imports again, 47-76 ms of CPU each (docs/benchmarks.md, "The
    collector's walks"). Frozen objects are never collected: they live as
    long as the process, and one that becomes cyclic garbage later stays,
    with what it holds then, once (nothing frozen is replaced while the
    process runs). What the process makes after this is still collected.

    The youngest generation is collected once the objects made since the
    last collection outnumber those freed by `YOUNG_GENERATION_THRESHOLD`,
    not CPython's 700. A worker makes its objects in bursts (a claim's
    payments at once), each payment's alive until its answer is recorded:
    at 700 it collected about once in eleven payments, walking the payments
    in flight and promoting them, and the collector took 4-6 % of its CPU;
    at 10,000 it collected one to four times a drain of 5,000 payments,
    0.2-0.7 % (docs/benchmarks.md, "The youngest generation collected less
    often"). Almost every object is freed by its count of references, not
    by the collector, so what waits longer is cyclic garbage: a cycle
    dropped before its first collection waits for up to that many container
    objects made (net of those freed) rather than 700, one promoted while
    alive for a collection of the middle generation, every tenth; and what
    such a cycle holds that is no container (an answer's bytes in an
    exception's frames) waits with it, uncounted."""
    # First what the start leaves behind (a schema check's engine, a retried
    # connection's garbage): frozen, it would stay for good.
    gc.collect()
    gc.freeze()
    _, middle, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_GENERATION_THRESHOLD, middle, oldest)


def run(main: Coroutine[Any, Any, T]) -> T:
    with declared_asyncio_thread(), asyncio.Runner(loop_factory=_loop_factory()) as runner:
        return runner.run(main)
