"""``RoleHooks``: how a worker role (unified, prefill, decode) plugs into the ``Scheduler``.

The scheduler calls these at fixed points of its loop; a role never reaches
into the scheduler's private state, it calls the scheduler's public
operations (``enqueue``, ``finish``, ``fail``, ``admit_prefilled``,
``alloc_prefilled_kv``, ``flush``) from inside a hook.  Every hook runs on the
scheduler thread.  ``UnifiedRole`` implements all of them as no-ops.

Contract per hook:

* ``check(request)``: why the role cannot serve ``request`` (a user-facing
  message, the request is rejected), or None.  Runs before the scheduler's
  own validation.
* ``admit(req, request)``: the request passed validation and is registered
  (``scheduler.reqs``); return True when the role took it into its own
  stages (it must then finish it or ``enqueue`` it later), False to let it
  join the waiting queue.
* ``before_schedule()``: advance the role's stages (poll transfers) before
  the next batch is chosen.
* ``on_prompt_done(req, token_id, logprob, top_logprobs)``: the prompt is
  computed and its first token sampled.  Return True when the role took the
  request (prefill ships it), False for the usual path (append the token,
  join the running batch).
* ``watch_forward(batch)``: an extend batch is about to launch.  A role
  that acts while its forward runs returns a ``ForwardWatch``: the launcher
  calls ``start()`` once the batch's KV slots are allocated, right before the
  model runs, and puts what it returns into ``ForwardBatch.layer_done``; then
  ``end(ok)`` when the model returned (``ok``) or raised (not ``ok``; the
  batch's requests are failed next).  None: nothing to watch (no cost).
* ``abort(rid, message)``: return True when the request sits in one of the
  role's stages and the role handled the abort (it finishes the request,
  now or once its transfer lets go of the slots); False lets the scheduler
  abort it.
* ``on_finish(req)``: ``req`` is being finished (any reason), before its KV is
  released; the role drops whatever it still holds for it.
* ``has_work()`` / ``poll_wait_s()``: whether the role has pending stages,
  and how long an otherwise idle loop may block before polling them again.
* ``close(message)``: the loop is exiting; finish every staged request with
  ``message`` and release the role's resources (transfer layer).
* ``stats()``: the role's entries of ``get_stats()``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional, Protocol

if TYPE_CHECKING:  # pragma: no cover
    from kvship.engine.io_struct import GenerateRequest
    from kvship.engine.schedule_batch import Req, ScheduleBatch


class ForwardWatch(Protocol):
    """What a role does while one batch's forward runs (``RoleHooks.watch_forward``)."""

    def start(self) -> Optional[Callable[[int], None]]: ...

    def end(self, ok: bool) -> None: ...


class RoleHooks(Protocol):
    mode: str

    def check(self, request: "GenerateRequest") -> Optional[str]: ...

    def admit(self, req: "Req", request: "GenerateRequest") -> bool: ...

    def before_schedule(self) -> None: ...

    def on_prompt_done(
        self, req: "Req", token_id: int, logprob: Optional[float], top_logprobs: Optional[list[tuple[int, float]]]
    ) -> bool: ...

    def watch_forward(self, batch: "ScheduleBatch") -> Optional[ForwardWatch]: ...

    def abort(self, rid: str, message: str) -> bool: ...

    def on_finish(self, req: "Req") -> None: ...

    def has_work(self) -> bool: ...

    def poll_wait_s(self) -> Optional[float]: ...

    def close(self, message: str) -> None: ...

    def stats(self) -> dict: ...


class UnifiedRole:
    """A worker that computes prompts and decodes them itself: every hook is a no-op."""

    mode = "unified"

    def check(self, request: "GenerateRequest") -> Optional[str]:
        return None

    def admit(self, req: "Req", request: "GenerateRequest") -> bool:
        return False

    def before_schedule(self) -> None:
        pass

    def on_prompt_done(
        self, req: "Req", token_id: int, logprob: Optional[float], top_logprobs: Optional[list[tuple[int, float]]]
    ) -> bool:
        return False

    def watch_forward(self, batch: "ScheduleBatch") -> Optional[ForwardWatch]:
        return None

    def abort(self, rid: str, message: str) -> bool:
        return False

    def on_finish(self, req: "Req") -> None:
        pass

    def has_work(self) -> bool:
        return False

    def poll_wait_s(self) -> Optional[float]:
        return None

    def close(self, message: str) -> None:
        pass

    def stats(self) -> dict:
        return {}
