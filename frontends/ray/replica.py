"""One spekula engine inside a Ray Serve replica: its own model, slots, threads and device.

The class is plain Python; frontends/ray/app.py turns it into a deployment. Ray runs the methods on
the replica's event loop, where the engine's scheduler loop also runs (started on first use, as a
task of that loop), so `Engine.submit` is called from the loop that owns it. Events travel back as
the engine's own dataclasses. Cancelling a call (the caller's client went away) cancels the engine
request at once. `check_health` is Ray's health hook: a replica whose scheduler loop has died
reports unhealthy and Ray replaces it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio

from spekula.core.events import Event, FinalEvent
from spekula.core.params import CompletionRequest


class EngineReplica:
    def __init__(self, args: argparse.Namespace, index: int) -> None:
        from spekula.frontends.cli.options import build_engine
        from spekula.frontends.logging_setup import configure_logging

        configure_logging(args.verbose, stdlib=True, log_format=args.log_format, events=True)
        self.index = index
        self.engine = build_engine(args)
        self.started_at = time.time()
        self._loop_task: asyncio.Task[None] | None = None
        self._running = asyncio.Event()

    async def _ensure_running(self) -> None:
        if self._loop_task is None:
            self._loop_task = asyncio.get_running_loop().create_task(self._serve())
        if not self._running.is_set():
            await self._running.wait()

    async def _serve(self) -> None:
        async with anyio.create_task_group() as tg:
            await tg.start(self.engine.run)
            self._running.set()
            await anyio.sleep_forever()

    async def complete(self, request: CompletionRequest) -> FinalEvent:
        await self._ensure_running()
        handle = self.engine.submit(request)
        try:
            return await handle.result()
        finally:
            if handle.final is None:  # cancelled by the caller: free the slot now
                handle.cancel()

    async def generate(self, request: CompletionRequest) -> AsyncIterator[Event]:
        await self._ensure_running()
        handle = self.engine.submit(request)
        try:
            async for event in handle:
                yield event
        finally:
            if handle.final is None:
                handle.cancel()

    async def describe(self) -> dict[str, Any]:
        """What the ingress needs to answer for the engine: its settings and model facts."""
        await self._ensure_running()
        e = self.engine
        return {"config": e.config, "model": e.backend.info, "props": e.props(), "pid": os.getpid()}

    async def report(self) -> dict[str, Any]:
        """Live state for /health, /slots and /metrics."""
        await self._ensure_running()
        e = self.engine
        return {"health": e.health(), "stats": e.stats(), "slots": e.slots(), "pid": os.getpid(),
                "started_at": self.started_at}

    async def check_health(self) -> None:
        await self._ensure_running()
        task = self._loop_task
        if task is not None and task.done():
            why = "cancelled" if task.cancelled() else repr(task.exception())
            raise RuntimeError(f"the engine loop of replica {self.index} stopped: {why}")
