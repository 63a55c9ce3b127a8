"""``--mode`` -> the scheduler of that worker role (the app shell's one map of roles)."""

from __future__ import annotations

from typing import Any, Callable


def scheduler_for_mode(mode: str) -> Callable[..., Any]:
    """The scheduler class of a worker role; all share ``Scheduler``'s constructor."""
    if mode == "unified":
        from kvship.engine.scheduler import Scheduler

        return Scheduler
    if mode == "prefill":
        from kvship.prefill.scheduler import PrefillScheduler

        return PrefillScheduler
    if mode == "decode":
        from kvship.decode.scheduler import DecodeScheduler

        return DecodeScheduler
    raise ValueError(f"unknown --mode '{mode}'")
