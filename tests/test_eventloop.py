"""Long-lived processes run their loop with the thread declared to sniffio."""

from __future__ import annotations

import sniffio

from intentledger import eventloop


def test_run_declares_its_thread_for_the_run_only() -> None:
    async def seen() -> str | None:
        return sniffio.thread_local.name

    assert sniffio.thread_local.name is None
    assert eventloop.run(seen()) == "asyncio"
    assert sniffio.thread_local.name is None


def test_a_declared_thread_still_names_asyncio_to_anyio() -> None:
    import anyio

    async def sleep_a_tick() -> str:
        await anyio.lowlevel.checkpoint()
        return sniffio.current_async_library()

    assert eventloop.run(sleep_a_tick()) == "asyncio"
