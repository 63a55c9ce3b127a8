"""The prefill worker (``kvship serve --mode prefill``).

Life cycle of a request on a prefill worker (one small class per stage)::

    1. bootstrap   BootstrapQueue (kvship.prefill.queues), only with --disaggregation-prefill-wait-for-room:
                   the request waits until the decode worker has registered its destination pages
    2. waiting     ComputingQueue (kvship.prefill.queues) + the scheduler's waiting queue and chunked
                   prefill (kvship.engine.scheduler.admission): a KVSender exists for the router's
                   bootstrap_room (decode may not have registered yet); prefix match in the radix
                   cache, extend(s), first token sampled
    3. inflight    InflightQueue (kvship.prefill.queues)
                   KV pages + aux record (first token, logprob, prompt length) handed to the sender,
                   which starts the transfer once decode registered the room; polled until
                   Success / Failed, then the KV goes to the radix cache and the HTTP reply
                   (status/metadata only) is sent

``PrefillRole`` (kvship.prefill.scheduler) plugs the stages into the
scheduler through its role hooks; ``kvship.engine.disagg.pd_role`` and
``kvship.engine.disagg.stages`` hold what prefill and decode share.  The transfer layer itself (bootstrap server, senders, backends) is
``kvship.engine.disagg``.
"""
