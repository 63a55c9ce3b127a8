"""The ``bucket`` policy (``kvship.router.policies.BucketPolicy``): prompt-length buckets of workers."""

from __future__ import annotations

import collections

from kvship.router.circuit import CircuitBreaker
from kvship.router.config import RouterConfig
from kvship.router.policies import BucketPolicy, create_policy
from kvship.router.wire import RoutingRequest, WorkerInfo
from kvship.router.worker import Worker


def workers(n: int) -> list[Worker]:
    out = []
    for i in range(n):
        w = Worker(url=f"http://w{i}:30000", role="unified", breaker=CircuitBreaker(5, 30))
        w.info = WorkerInfo(models=("m",))
        w.healthy = True
        out.append(w)
    return out


def req(length: int) -> RoutingRequest:
    return RoutingRequest(
        route="/generate", body={}, raw=b"", text="x" * length, model=None, stream=False, session_id=None
    )


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_initial_buckets_split_the_span_evenly_in_url_order():
    policy = BucketPolicy(RouterConfig(bucket_initial_span=3000), clock=Clock())
    ws = workers(3)
    picks = {n: policy.select(list(reversed(ws)), req(n)).url for n in (0, 999, 1000, 1999, 2000, 50_000)}
    assert policy.bounds == [1000, 2000]
    assert picks == {0: ws[0].url, 999: ws[0].url, 1000: ws[1].url, 1999: ws[1].url, 2000: ws[2].url, 50_000: ws[2].url}


def test_bounds_are_refitted_so_each_bucket_gets_an_equal_share_of_recent_characters():
    clock = Clock()
    policy = BucketPolicy(RouterConfig(bucket_initial_span=4096, bucket_adjust_interval=5.0), clock=clock)
    ws = workers(2)
    lengths = [100] * 30 + [3000] * 1  # 3000 chars of short prompts, 3000 of one long one
    for n in lengths:
        policy.select(ws, req(n))
        clock.now += 0.01
    assert policy.bounds == [2048]  # not refitted within the interval
    clock.now = 5.0
    policy.select(ws, req(100))
    assert policy.bounds == [101]  # the 30 x 100 chars reach half of the window's 6000: 100 is the lower bucket's
    assert policy.bucket_of(100) == 0 and policy.bucket_of(3000) == 1
    chosen = collections.Counter(policy.select(ws, req(n)).url for n in lengths)
    assert chosen == {ws[0].url: 30, ws[1].url: 1}
    clock.now = 100.0  # the window empties: back to the even split once it is refitted
    policy.select(ws, req(10))
    assert policy.bounds == [2048]


def test_a_worker_joining_refits_the_buckets_at_once():
    policy = BucketPolicy(RouterConfig(bucket_initial_span=4000), clock=Clock())
    ws = workers(3)
    policy.select(ws[:2], req(10))
    assert policy.bounds == [2000]
    policy.select(ws, req(10))
    assert len(policy.bounds) == 2


def test_imbalanced_load_goes_to_the_least_loaded_worker():
    policy = create_policy("bucket", RouterConfig(balance_abs_threshold=2, balance_rel_threshold=1.5))
    ws = workers(2)
    ws[0].in_flight = 10
    assert policy.select(ws, req(1)) is ws[1]  # bucket 0's worker is overloaded
    ws[0].in_flight = 1
    assert policy.select(ws, req(1)) is ws[0]
