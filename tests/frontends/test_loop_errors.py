"""The servers' loop exception handler: a late socket wake-up on a cancelled wait is one debug line,
every other loop error still reaches asyncio's handler."""

from __future__ import annotations

import asyncio
import logging

import pytest

from spekula.frontends.loop_errors import quiet_late_socket_wakeups


def test_a_late_set_result_on_a_cancelled_wait_is_not_logged_as_an_error(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        quiet_late_socket_wakeups()
        loop = asyncio.get_running_loop()
        f = loop.create_future()
        f.cancel()
        loop.call_soon(f.set_result, None)  # what the selector does when the socket turns ready too late
        loop.call_soon(lambda: 1 / 0)  # any other error still goes to asyncio's own handler
        await asyncio.sleep(0.01)

    with caplog.at_level(logging.DEBUG):
        asyncio.run(main())
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "ZeroDivisionError" in (errors[0].exc_text or str(errors[0].exc_info))
    assert any("already ended" in r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG)
