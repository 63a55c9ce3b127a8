"""The scheduler, composed of single-job parts (see ``core`` for the loop).

* ``core.Scheduler``: the request state and the public steps of the loop.
* ``admission``: prompt checks and extend batches (prefix binding, chunking).
* ``decode``: decode batches and retraction.
* ``kv_budget.KVBudget``: page rounding, decode reserve and need.
* ``launch``: forward + sample without waiting; ``Pending`` results.
* ``overlap.OverlapLoop``: the loop that chains decode steps on the device.
* ``role.RoleHooks``: how the prefill and decode roles plug in.
* ``inbox``: submit / abort messages from other threads.
"""

from kvship.engine.scheduler.core import Scheduler, overlap_enabled
from kvship.engine.scheduler.inbox import SchedulerClosedError
from kvship.engine.scheduler.role import RoleHooks, UnifiedRole

__all__ = ["RoleHooks", "Scheduler", "SchedulerClosedError", "UnifiedRole", "overlap_enabled"]
