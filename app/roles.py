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
    ``Speculator`` (``kvship.decode.spec``).  In PD (docs/speculative.md, "PD")
    an EAGLE decode worker registers its drafter's per-slot features with the
    transfer layer, and a prefill worker given ``eagle`` / ``eagle3`` computes
    the prompt's features (``PromptFeatures``) and ships them with the KV; a
    prefill worker refuses ``ngram`` and ``draft`` (they need nothing from it).
    """
    cls = _scheduler_class(mode)

    def build(server_args: Any, model_runner: Any, tokenizer: Any, output_sink: Any, **kw: Any) -> Any:
        algo = getattr(server_args, "speculative_algorithm", None)
        if algo is not None and mode == "prefill":
            if algo in ("eagle", "eagle3"):
                from kvship.decode.spec.prompt_features import PromptFeatures

                kw["slot_features"] = PromptFeatures(server_args, model_runner).slot_features
            else:
                raise ValueError(
                    f"--speculative-algorithm {algo} drafts on the decode worker from tokens alone and needs "
                    "nothing from a prefill worker: drop --speculative-* from the prefill worker (only eagle and "
                    "eagle3 use it there, to ship the prompt's features)"
                )
        elif algo is not None:
            from kvship.decode.spec.worker import Speculator, create_drafter

            drafter = create_drafter(server_args)
            if mode == "decode":
                features = drafter.transfer_features(model_runner)
                if features is not None:
                    kw["slot_features"] = features
            kw["speculator"] = lambda sched: Speculator(sched, drafter)
        return cls(server_args, model_runner, tokenizer, output_sink, **kw)

    return build
