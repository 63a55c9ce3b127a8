"""Running a KV-transfer scenario (several managers in one process) in a spawned process, for the PD TP/PP tests.

The scenario is a module-level function returning a picklable dict; a scenario that raises is reported with its
traceback, one that hangs fails the test after ``timeout`` seconds, and the process exits without the slow library
teardown (UCX, mooncake).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback
from typing import Any, Callable

import pytest

from kvship.engine.disagg.base import BackendUnavailableError, get_transfer_backend


def _main(conn, scenario: Callable[..., dict], args: tuple) -> None:
    try:
        conn.send(("ok", scenario(*args)))
    except Exception:  # noqa: BLE001 - report to the test
        conn.send(("err", traceback.format_exc()))
    conn.close()
    os._exit(0)


def run_scenario(scenario: Callable[..., dict], backend: str, *args: Any, timeout: float = 90) -> dict:
    """``scenario(backend, *args)`` in a spawned process; skipped when ``backend`` is not installed here."""
    try:
        get_transfer_backend(backend)
    except BackendUnavailableError as e:
        pytest.skip(str(e))
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_main, args=(child, scenario, (backend, *args)))
    proc.start()
    try:
        assert parent.poll(timeout), "the transfer scenario hung"
        status, value = parent.recv()
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    assert status == "ok", value
    return value
