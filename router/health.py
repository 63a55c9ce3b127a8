"""Background health checker: every ``--health-check-interval`` seconds, check every worker concurrently.

A worker turns unhealthy after ``--health-failure-threshold`` consecutive
failed checks and healthy again after ``--health-success-threshold`` passed
ones (``WorkerRegistry.check`` keeps the counters).  The loop never dies on
one worker's error.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Optional

from kvship.router.worker import WorkerRegistry

logger = logging.getLogger(__name__)


class HealthChecker:
    def __init__(self, registry: WorkerRegistry, interval: float):
        self.registry = registry
        self.interval = interval
        self._task: Optional[asyncio.Task] = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="kvship-router-health")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def check_all(self) -> None:
        workers = self.registry.all()
        results = await asyncio.gather(*(self.registry.check(w) for w in workers), return_exceptions=True)
        for w, r in zip(workers, results):
            if isinstance(r, Exception):
                logger.error("health check of %s raised %r", w.url, r)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            await self.check_all()
            await asyncio.sleep(max(0.0, self.interval - (loop.time() - started)))
