"""``--mode`` -> the scheduler of that worker role (the app shell's one map of roles)."""

from __future__ import annotations

from typing import Any, Callable


def _scheduler_class(mode: str) -> type:
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


def scheduler_for_mode(mode: str) -> Callable[..., Any]:
    """A factory ``(server_args, model_runner, tokenizer, output_sink, **kw) -> scheduler`` for a worker role.

    With ``--speculative-algorithm`` the unified and decode schedulers get a
    ``Speculator`` (``kvship.decode.spec``); a prefill worker refuses it.
    """
    cls = _scheduler_class(mode)

    def build(server_args: Any, model_runner: Any, tokenizer: Any, output_sink: Any, **kw: Any) -> Any:
        if getattr(server_args, "speculative_algorithm", None) is not None:
            if mode == "prefill":
                raise ValueError(
                    "speculative decoding runs on decode (and unified) workers: "
                    "drop --speculative-* from the prefill worker"
                )
            from kvship.decode.spec.worker import Speculator, create_drafter

            drafter = create_drafter(server_args)
            kw["speculator"] = lambda sched: Speculator(sched, drafter)
        return cls(server_args, model_runner, tokenizer, output_sink, **kw)

    return build
