"""The SLO planner's control law (kvship.operator.planner) on recorded router figures, and its spec/builders."""

from __future__ import annotations

import pytest

from kvship.operator.builders import Images, build_children
from kvship.operator.planner import Figures, Planner, PlannerSettings, RoleLoad, RoleTarget, figures_from_router
from kvship.operator.planner_loop import PlannerLoop, planner_setup, scale_event
from kvship.operator.spec import SpecError, parse_service

REV = "aaaaaaaaaaaa"
PD_TARGETS = [
    RoleTarget("prefill", 1, 4, ttft_ms=500.0),
    RoleTarget("decode", 1, 6, itl_ms=50.0),
]
FAST = PlannerSettings(scale_up_window_s=0, scale_down_window_s=0, cooldown_s=0, max_step_up=2, max_step_down=1)


def workers(prefill: tuple[int, int], decode: tuple[int, int], old_decode: int = 0) -> list[dict]:
    """GET /workers entries: (serving workers, in flight) per role; ``old_decode`` draining workers of another
    revision with 5 requests each."""
    out = []
    for role, (n, busy) in (("prefill", prefill), ("decode", decode)):
        for i in range(n):
            share = busy // n + (1 if i < busy % n else 0)
            out.append({"role": role, "revision": REV, "in_rotation": True, "in_flight": share})
    out += [{"role": "decode", "revision": "bbbbbbbbbbbb", "in_rotation": False, "in_flight": 5}] * old_decode
    return out


def slo(requests: int, ttft: float | None, itl: float | None, rps: float | None) -> dict:
    return {"window_s": 60.0, "requests": requests, "ttft_p90_ms": ttft, "itl_p50_ms": itl, "requests_per_second": rps}


def decisions(planner: Planner, figures: Figures, current: dict[str, int], now: float) -> dict[str, int]:
    out = {}
    for d in planner.step(figures, current, now):
        planner.applied(d, now)
        out[d.role] = d.desired
    return out


def test_figures_count_only_the_current_revisions_serving_workers_but_every_request_in_flight():
    f = figures_from_router(slo(40, 300.0, 20.0, 2.0), workers((1, 2), (2, 7), old_decode=2), REV)
    assert f.load("prefill") == RoleLoad(serving=1, in_flight=2)
    assert f.load("decode") == RoleLoad(serving=2, in_flight=17)  # draining workers still run requests
    assert (f.ttft_p90_ms, f.itl_p50_ms, f.requests_per_second, f.requests) == (300.0, 20.0, 2.0, 40)
    junk = figures_from_router({"ttft_p90_ms": "x", "itl_p50_ms": float("nan"), "requests": True}, [{"role": 3}], REV)
    assert (junk.ttft_p90_ms, junk.itl_p50_ms, junk.requests, junk.roles) == (None, None, 0, {})


def test_recorded_ramp_scales_decode_on_itl_prefill_on_ttft_then_back_down():
    p = Planner(FAST, PD_TARGETS)
    cur = {"prefill": 1, "decode": 1}
    # low load: both met, nothing moves
    cur.update(decisions(p, figures_from_router(slo(60, 200.0, 20.0, 1.0), workers((1, 1), (1, 4)), REV), cur, 0))
    assert cur == {"prefill": 1, "decode": 1}
    # decode concurrency climbs: ITL misses -> decode up, prefill (TTFT met) stays
    cur.update(decisions(p, figures_from_router(slo(200, 300.0, 90.0, 3.0), workers((1, 1), (1, 16)), REV), cur, 10))
    assert cur["prefill"] == 1 and cur["decode"] == 3  # capacity ~16*50/90 -> want 4, step 2
    cur.update(decisions(p, figures_from_router(slo(300, 350.0, 60.0, 3.0), workers((1, 1), (3, 18)), REV), cur, 20))
    # still missing: one more (the capacity, ~5.8/replica at 0.8, wants 4 for 18 in flight)
    assert cur == {"prefill": 1, "decode": 4}
    # request rate climbs: TTFT misses -> prefill up; decode within target stays
    cur.update(decisions(p, figures_from_router(slo(500, 1400.0, 42.0, 8.0), workers((1, 6), (4, 18)), REV), cur, 30))
    assert cur == {"prefill": 3, "decode": 4}
    # TTFT met but above 0.8 x target: prefill grows ahead of a miss; ITL comfortably met: decode holds
    cur.update(decisions(p, figures_from_router(slo(500, 450.0, 40.0, 8.0), workers((3, 3), (4, 18)), REV), cur, 40))
    assert cur == {"prefill": 4, "decode": 4}
    # load falls: one replica at a time, down to minReplicas
    seen = []
    for t in range(50, 200, 10):
        f = figures_from_router(slo(30, 120.0, 12.0, 0.5), workers((cur["prefill"], 0), (cur["decode"], 2)), REV)
        cur.update(decisions(p, f, cur, t))
        seen.append(dict(cur))
    assert seen[:4] == [{"prefill": 3, "decode": 3}, {"prefill": 2, "decode": 2}, {"prefill": 1, "decode": 1}] + [
        {"prefill": 1, "decode": 1}
    ]
    assert cur == {"prefill": 1, "decode": 1}
    # no traffic at all -> minReplicas
    assert decisions(p, figures_from_router(slo(0, None, None, None), workers((1, 0), (1, 0)), REV), cur, 300) == cur


def test_cooldown_and_step_limit_hold_a_role_between_changes():
    p = Planner(PlannerSettings(scale_down_window_s=0, cooldown_s=60, max_step_up=1), PD_TARGETS)
    cur = {"prefill": 1, "decode": 1}
    miss = figures_from_router(slo(100, 200.0, 200.0, 1.0), workers((1, 0), (1, 30)), REV)
    cur.update(decisions(p, miss, cur, 0))
    assert cur["decode"] == 2  # step 1, though capacity says more
    held = p.step(miss, cur, 30)
    assert [d.desired for d in held if d.role == "decode"] == [2]
    assert "cooldown" in next(d.message for d in held if d.role == "decode")
    cur.update(decisions(p, miss, cur, 61))
    assert cur["decode"] == 3


def test_scale_down_waits_for_the_stabilisation_window_and_a_dip_does_not_scale_down():
    p = Planner(PlannerSettings(scale_down_window_s=120, cooldown_s=0), PD_TARGETS)
    cur = {"prefill": 1, "decode": 4}
    busy = figures_from_router(slo(300, 200.0, 38.0, 1.0), workers((1, 0), (4, 20)), REV)
    quiet = figures_from_router(slo(300, 200.0, 10.0, 1.0), workers((1, 0), (4, 4)), REV)
    cur.update(decisions(p, busy, cur, 0))
    assert cur["decode"] == 4
    cur.update(decisions(p, quiet, cur, 30))  # a dip: the busy want of t=0 is still in the window
    assert cur["decode"] == 4
    for t in (60, 90, 120):
        cur.update(decisions(p, quiet, cur, t))
    assert cur["decode"] == 4
    cur.update(decisions(p, quiet, cur, 151))  # the window now holds only quiet wants
    assert cur["decode"] == 3


def test_bounds_win_over_everything_and_a_profile_seeds_capacity():
    p = Planner(FAST, [RoleTarget("decode", 2, 3, itl_ms=50.0, profile_concurrency=4.0)])
    # below minReplicas: raised at once even with no traffic
    assert decisions(p, Figures(), {"decode": 1}, 0) == {"decode": 2}
    # 40 in flight at capacity 4 x 0.8 wants 13; maxReplicas caps it
    hot = figures_from_router(slo(100, None, 49.0, 1.0), workers((0, 0), (2, 40)), None)
    assert p.capacity("decode")["concurrency"] == 4.0
    d = p.step(hot, {"decode": 2}, 1)[0]
    assert d.desired == 3 and "bounded to [2, 3]" in d.message


def test_unified_workers_follow_the_worse_of_ttft_and_itl():
    p = Planner(FAST, [RoleTarget("unified", 1, 5, ttft_ms=500.0, itl_ms=50.0)])
    ws = [{"role": "unified", "revision": REV, "in_rotation": True, "in_flight": 3}]
    ttft_miss = figures_from_router(slo(100, 900.0, 30.0, 2.0), ws, REV)
    d = p.step(ttft_miss, {"unified": 1}, 0)[0]
    # capacity 2 req/s x 500/900 per replica, planned at 0.8 of it: 2 req/s wants 3 replicas
    assert d.desired == 3 and d.reason == "ScaledUp" and "ttft p90 900 ms > target 500 ms" in d.message


def roles(prefill_tps=None, queued=(None, None), running=(None, None), kv=(None, None)) -> dict:
    """``roles`` of GET /slo: per role the figures its workers report."""
    out = {}
    for i, role in enumerate(("prefill", "decode")):
        out[role] = {
            "workers": 1,
            "prompt_tokens_per_second": prefill_tps if role == "prefill" else None,
            "queue_depth": queued[i],
            "running": running[i],
            "kv_usage": kv[i],
        }
    return out


def test_figures_take_token_rates_queues_and_kv_usage_per_role_from_the_router():
    body = {**slo(50, 300.0, 20.0, 2.0), "roles": roles(4000.0, (2, 1), (1, 9), (0.3, 0.7))}
    f = figures_from_router(body, workers((1, 1), (2, 8)), REV)
    assert f.load("prefill") == RoleLoad(
        serving=1, in_flight=1, prompt_tokens_per_second=4000.0, queue_depth=2, running=1, kv_usage=0.3
    )
    assert f.load("decode").concurrent == 10  # the workers' own running + queued, not the router's 8
    assert RoleLoad(serving=1, in_flight=8).concurrent == 8  # no report: the router's in-flight count
    assert "prefill 1 in flight on 1, 4000 prompt tok/s, 1 running, 2 queued, kv 30%" in f.describe()
    junk = figures_from_router({"roles": {"decode": {"queue_depth": -1, "running": 1.5, "kv_usage": "x"}}}, [], REV)
    assert junk.load("decode") == RoleLoad()


def test_prefill_scales_with_prompt_token_throughput_when_prompts_grow_at_the_same_request_rate():
    p = Planner(FAST, PD_TARGETS)
    cur = {"prefill": 2, "decode": 1}
    # 2 req/s of 1000-token prompts: TTFT 400 ms of 500 -> capacity ~ 1000 tok/s x 500/400 per replica
    short = {**slo(100, 400.0, 20.0, 2.0), "roles": roles(2000.0, (0, 0), (1, 1), (0.2, 0.2))}
    cur.update(decisions(p, figures_from_router(short, workers((2, 1), (1, 1)), REV), cur, 0))
    assert cur["prefill"] == 2
    assert p.capacity("prefill")["prompt_tokens_per_second"] == pytest.approx(1250.0)
    # the same 2 req/s with 3x longer prompts: TTFT misses; the token rate, not the request rate, sizes it
    long = {**slo(100, 900.0, 20.0, 2.0), "roles": roles(6000.0, (0, 0), (1, 1), (0.2, 0.2))}
    d = next(d for d in p.step(figures_from_router(long, workers((2, 1), (1, 1)), REV), cur, 10) if d.role == "prefill")
    assert d.desired == 4 and "prompt tok/s" in d.message and "ttft p90 900 ms > target 500 ms" in d.message


def test_a_role_queueing_on_full_kv_grows_and_a_queueing_role_never_shrinks():
    p = Planner(FAST, PD_TARGETS)
    # ITL met comfortably, but decode's KV is full and requests queue: it cannot admit them, one more replica
    full = {**slo(100, 200.0, 10.0, 1.0), "roles": roles(100.0, (0, 5), (0, 4), (0.1, 0.95))}
    d = {
        x.role: x
        for x in p.step(figures_from_router(full, workers((1, 0), (2, 9)), REV), {"prefill": 1, "decode": 2}, 0)
    }
    assert d["decode"].desired == 3 and "5 queued with kv 95% >= 90%: full" in d["decode"].message
    assert d["prefill"].desired == 1
    # latency well met with KV to spare, but more requests queue than there are replicas: no shrink
    queued = {**slo(100, 100.0, 5.0, 1.0), "roles": roles(100.0, (0, 4), (0, 2), (0.1, 0.5))}
    d = {
        x.role: x
        for x in p.step(figures_from_router(queued, workers((1, 0), (3, 6)), REV), {"prefill": 1, "decode": 3}, 2)
    }
    assert d["decode"].desired == 3 and "not shrinking" in d["decode"].message


def test_a_role_scaled_up_on_misses_comes_back_once_latency_is_far_below_its_target():
    # figures of tests/test_operator_planner_ramp.py: misses teach a low capacity; at low load the per-replica
    # token rate is far above what was ever seen met, yet TTFT is far below target: that bounds capacity up
    p = Planner(FAST, [RoleTarget("prefill", 1, 2, ttft_ms=400.0)])
    one = [{"role": "prefill", "revision": REV, "in_rotation": True}]
    hot = {**slo(12, 2245.0, None, 2.4), "roles": {"prefill": {"prompt_tokens_per_second": 2238.0}}}
    assert decisions(p, figures_from_router(hot, one, REV), {"prefill": 1}, 0) == {"prefill": 2}
    assert p.capacity("prefill")["prompt_tokens_per_second"] == pytest.approx(2238.0 / 4)  # the clamp
    low = {**slo(50, 80.0, None, 10.0), "roles": {"prefill": {"prompt_tokens_per_second": 1200.0}}}
    d = p.step(figures_from_router(low, one * 2, REV), {"prefill": 2}, 10)[0]
    assert d.desired == 1 and "1200 prompt tok/s over capacity 1.5e+03" in d.message, d.message


def test_settings_and_targets_refuse_nonsense():
    with pytest.raises(ValueError):
        PlannerSettings(utilization=0)
    with pytest.raises(ValueError):
        PlannerSettings(max_step_down=0)
    with pytest.raises(ValueError):
        RoleTarget("decode", 3, 2, itl_ms=1.0)
    with pytest.raises(ValueError):
        RoleTarget("decode", 1, 2)


# ----------------------------------------------------------------------------- spec, builders, events
def body(**spec) -> dict:
    base = {"model": {"uri": "builtin:smollm2"}}
    base.update(spec)
    return {"metadata": {"name": "llm", "namespace": "ns", "uid": "u-1", "generation": 1}, "spec": base}


PD_SLO = dict(
    prefill={"replicas": 1, "autoscaling": {"minReplicas": 1, "maxReplicas": 3}},
    decode={"replicas": 1, "autoscaling": {"minReplicas": 1, "maxReplicas": 4}},
    slo={"ttftP90Ms": 500, "itlP50Ms": 50},
    autoscaling={"mode": "slo", "cooldownSeconds": 5, "profile": {"decodeConcurrency": 8}},
)


def test_slo_mode_needs_the_targets_of_the_roles_it_scales():
    with pytest.raises(SpecError) as e:
        parse_service(body(**{**PD_SLO, "slo": {"ttftP90Ms": 500}}))
    assert e.value.errors == ["spec.slo.itlP50Ms: slo mode scales decode from ITL and needs this target"]
    with pytest.raises(SpecError) as e:
        parse_service(body(decode={"replicas": 1}, autoscaling={"mode": "slo"}, slo={"itlP50Ms": 50}))
    assert "spec.decode.autoscaling" in e.value.errors[0]
    with pytest.raises(SpecError):
        parse_service(body(**{**PD_SLO, "autoscaling": {"mode": "slo", "maxScaleUpStep": 0}}))
    parse_service(body(**PD_SLO))


def test_slo_mode_builds_no_worker_hpa_and_leaves_replicas_to_the_planner():
    cfg = parse_service(body(**PD_SLO, router={"autoscaling": {"maxReplicas": 2}}))
    children = build_children(cfg, Images(worker="w:1", router="r:1"))
    hpas = [c["metadata"]["name"] for c in children if c["kind"] == "HorizontalPodAutoscaler"]
    assert hpas == ["llm-router"]
    workers_ = [c for c in children if c["kind"] == "Deployment" and "router" not in c["metadata"]["name"]]
    assert len(workers_) == 2 and all("replicas" not in d["spec"] for d in workers_)
    hpa_cfg = parse_service(body(**{**PD_SLO, "autoscaling": {"mode": "hpa"}}))
    kinds = [
        c["metadata"]["name"]
        for c in build_children(hpa_cfg, Images(worker="w:1", router="r:1"))
        if c["kind"] == "HorizontalPodAutoscaler"
    ]
    assert sorted(kinds) == ["llm-decode", "llm-prefill"]


def test_planner_setup_and_the_event_name_the_service_and_reason():
    cfg = parse_service(body(**PD_SLO))
    settings, targets = planner_setup(cfg)
    assert settings.cooldown_s == 5 and settings.scale_down_window_s == 300
    assert [(t.role, t.min_replicas, t.max_replicas, t.ttft_ms, t.itl_ms, t.profile_concurrency) for t in targets] == [
        ("prefill", 1, 3, 500, None, None),
        ("decode", 1, 4, None, 50, 8),
    ]
    loop = PlannerLoop()
    assert loop.planner_for(cfg) is loop.planner_for(cfg)
    assert loop.planner_for(parse_service(body(**{**PD_SLO, "autoscaling": {"mode": "hpa"}}))) is None
    p = loop.planner_for(cfg)
    d = p.step(figures_from_router(slo(50, 100.0, 80.0, 1.0), workers((1, 0), (1, 8)), REV), {"decode": 1}, 0)[0]
    ev = scale_event(cfg, d, "2026-01-01T00:00:00Z")
    assert ev["involvedObject"]["uid"] == "u-1" and ev["reason"] == "ScaledUp" and ev["type"] == "Normal"
    assert ev["message"].startswith("decode 1 -> 2: itl p50 80 ms > target 50 ms")


def test_a_role_whose_scale_up_is_not_serving_yet_is_never_shrunk():
    p = Planner(FAST, PD_TARGETS)
    # decode was scaled 1 -> 2; the new replica is not in the router's rotation yet, and ITL already looks
    # met (the load has not moved): shrinking now would undo the scale-up before it was judged
    met = slo(100, 100.0, 5.0, 1.0)
    d = {
        x.role: x
        for x in p.step(figures_from_router(met, workers((1, 0), (1, 2)), REV), {"prefill": 1, "decode": 2}, 0)
    }
    assert d["decode"].desired == 2 and "1 of 2 replicas serving: not shrinking" in d["decode"].message
    # once both serve, the same figures shrink it
    d = {
        x.role: x
        for x in p.step(figures_from_router(met, workers((1, 0), (2, 2)), REV), {"prefill": 1, "decode": 2}, 1)
    }
    assert d["decode"].desired == 1 and d["decode"].reason == "ScaledDown"
    # no traffic at all: back to minReplicas whatever is serving
    idle = slo(0, None, None, None)
    d = {
        x.role: x
        for x in p.step(figures_from_router(idle, workers((1, 0), (1, 0)), REV), {"prefill": 1, "decode": 2}, 2)
    }
    assert d["decode"].desired == 1
