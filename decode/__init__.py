"""The decode worker (``kvship serve --mode decode``).

Life cycle of a request on a decode worker (one small class per stage)::

    1. prealloc    PreallocQueue (kvship.decode.queues)
                   a KVReceiver exists for the room; the request waits until KV slots for
                   its whole prompt fit next to what the running requests still need
    2. transfer    TransferQueue (kvship.decode.queues)
                   pages registered with the prefill worker's bootstrap endpoint; prefill
                   writes every layer's K/V pages and then the aux record into them
    3. waiting     PrebuiltQueue (kvship.decode.queues)
                   KV in place, first token known: joins the running batch as a prebuilt
                   extend (``Scheduler.admit_prefilled``, no prompt recompute)
    4. running     the scheduler's running batch (kvship.engine.scheduler): decode steps,
                   tokens streamed to the client; finished KV goes to the radix cache

``DecodeRole`` (kvship.decode.scheduler) plugs the stages into the
scheduler through its role hooks.
"""
