"""Router policies on a multi-tenant multi-turn workload: ``kv_events`` against ``cache_aware``.

Builds a tiny random llama (transformers, written to a temporary directory),
starts ``--workers`` real CPU workers with small KV pools (``--pool-tokens``
device tokens, page size 4, a host tier of ``--hicache-ratio`` times that,
``--enable-kv-events``) behind ``kvship router`` (subprocesses), and sends the
same workload once per policy, each time to fresh workers:

* ``--tenants`` x ``--sessions`` conversations of ``--turns`` turns; a
  conversation's first prompt is its tenant's ``--system-tokens`` random ids
  (shared by the tenant's sessions) plus ``--user-tokens`` ids, each
  later prompt is the previous prompt + the reply's ids + ``--user-tokens``
  new ids (token-id ``/generate`` requests, so ``kv_events`` can hash them);
* tenants run concurrently (at most ``--concurrency`` requests in flight),
  each tenant's turns one after the other; the sum of the final contexts is
  several times the device pools, so pages are evicted during the run.

* ``--routers N`` runs N router replicas with the same policy over the same
  workers (as a Deployment of N router pods behind one Service) and a
  tenant's turns alternate between them (``--router-choice random``: each turn
  goes to a replica drawn at random, the same draws for every policy, as a
  Service spreads new connections): each ``cache_aware`` replica sees only the
  turns sent through it, each ``kv_events`` replica follows every worker's
  events.

Reports, per policy, the share of prompt tokens served from cache (sum of the
replies' ``meta_info.cached_tokens`` over the sum of ``prompt_tokens``), the
same for returning turns only (turn >= 2), TTFT p50/p90 (first streamed event,
through the router), how often a tenant's turn moved to another worker and
the CPU seconds the routers and the workers spent while the turns ran (every
process shares this box's cores, so a router's CPU is the workers' loss);
for ``kv_events`` the routers' predicted against actual cached tokens per
request and the returning prompts every worker had lost (their
``kvship_router_kv_*`` metrics); then the difference in points and the TTFT
ratio.  ``--contain-thrash both`` runs ``kv_events`` once with the router's
``--no-kv-events-contain-thrash`` and once with it on (default: on only);
``--pending both`` (the default) the same for ``--kv-events-pending``.
docs/cache.md, "Routing on KV events" and "Thrash containment".

* ``--think-ms T`` pauses each user between a reply and the next turn
  (0.5-1.5x T, the same pauses for every policy; no slot held meanwhile);
  ``--plans 3,3,6 ...`` adds runs with every conversation's worker fixed in
  advance (conversations per worker), sent straight to the workers without a
  router: placements chosen knowing the workload, to set the policies against.

    nice -n 19 .venv/bin/python bench/router_kv_events.py [--routers 2 [--router-choice random]] [--seeds 1 2 3 4]

``--seeds`` repeats the comparison per seed and ends with the per-seed differences and their mean.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Iterator, Optional

import aiohttp
import httpx

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEY = "b" * 32
PAGE = 4
VOCAB = 384
LOW, HIGH = 3, 380  # prompt ids: clear of the special tokens (0-2) and inside the vocabulary


# -- a tiny model with a tokenizer ----------------------------------------------------------------------------------


def build_model(out_dir: str, seed: int = 1) -> str:
    """A 2-layer llama with random weights and a small byte-level BPE tokenizer in ``out_dir``."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).to(torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.1 * noise)
    model.save_pretrained(out_dir, safe_serialization=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<unk>", "<s>", "</s>"]
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = ["Routing requests to the worker that already holds their prefix saves prefill work."] * 8
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<unk>"
    )
    assert len(fast) <= VOCAB
    fast.save_pretrained(out_dir)
    return out_dir


# -- processes ------------------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Proc:
    name: str
    url: str
    popen: subprocess.Popen
    log: str

    def tail(self, n: int = 40) -> str:
        with open(self.log, "rb") as f:
            return "\n".join(f.read().decode("utf-8", "replace").splitlines()[-n:])

    def stop(self) -> None:
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGTERM)  # own session: pgid == pid
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(10)
        with contextlib.suppress(OSError):
            os.unlink(self.log)


def spawn(name: str, subcommand: str, args: list[str]) -> Proc:
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix=f"kvbench-{name}-", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "kvship.app.cli", subcommand, *args, "--host", "127.0.0.1", "--port", str(port)]
    popen = subprocess.Popen(
        cmd,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        start_new_session=True,
    )
    log.close()
    return Proc(name, f"http://127.0.0.1:{port}", popen, log.name)


def wait_healthy(procs: list[Proc], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    pending = list(procs)
    while pending:
        for p in list(pending):
            if p.popen.poll() is not None:
                raise RuntimeError(f"{p.name} exited with {p.popen.returncode}:\n{p.tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(p.url + "/health", timeout=2.0).status_code == 200:
                    pending.remove(p)
        if pending and time.monotonic() > deadline:
            raise RuntimeError(f"{pending[0].name} not healthy after {timeout:.0f} s:\n{pending[0].tail()}")
        time.sleep(0.3)


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time of processes ``pids`` and their waited-for children so far (Linux ``/proc``; 0 where
    it cannot be read)."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError, ValueError, IndexError):
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += sum(int(x) for x in fields[11:15])  # utime, stime, cutime, cstime
    return total / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def cluster(
    model_dir: str, policy: str, router_extra: list[str], args
) -> Iterator[tuple[list[str], list[str], list[int], list[int]]]:
    """Fresh workers and ``--routers`` routers with ``policy`` (+ ``router_extra`` flags), each following every
    worker; yields (router URLs, worker URLs, router pids, worker pids); stops them all."""
    worker_args = [
        "--model-path", model_dir,
        "--served-model-name", "tiny",
        "--page-size", str(PAGE),
        "--max-total-tokens", str(args.pool_tokens),
        "--max-running-requests", "4",
        "--enable-kv-events",
        "--api-key", KEY,
    ]  # fmt: skip
    if args.hicache_ratio > 0:
        worker_args += ["--hicache-ratio", str(args.hicache_ratio)]
    procs: list[Proc] = []
    try:
        workers = [spawn(f"worker{i}", "serve", worker_args) for i in range(args.workers)]
        procs += workers
        wait_healthy(workers, 300)
        urls = [w.url for w in workers]
        routers = [
            spawn(
                f"router{i}-{policy}",
                "router",
                ["--worker-urls", *urls, "--policy", policy, "--worker-api-key", KEY, "--debug-headers", *router_extra],
            )
            for i in range(args.routers)
        ]
        procs += routers
        wait_healthy(routers, 60)
        yield [r.url for r in routers], urls, [r.popen.pid for r in routers], [w.popen.pid for w in workers]
    finally:
        for p in procs:
            p.stop()


# -- the workload ---------------------------------------------------------------------------------------------------


@dataclass
class Result:
    policy: str
    prompt: list[int] = field(default_factory=list)  # per request, turn order within tenants
    cached: list[int] = field(default_factory=list)
    turn: list[int] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    moves: int = 0
    first: dict = field(default_factory=dict)  # worker URL -> tenants whose first turn went there
    errors: int = 0
    wall_s: float = 0.0
    # the routers' predicted vs actual cached tokens (kv_events only; summed over the router replicas)
    predictions: dict = field(default_factory=dict)  # outcome (exact/under/over) -> requests
    predicted_sum: float = 0.0
    actual_sum: float = 0.0
    error_sum: float = 0.0
    lost: dict = field(default_factory=dict)  # placement (contained/spread) -> returning prompts every worker lost
    # CPU seconds the routers and the workers spent while the turns ran (this box's cores are shared by all)
    router_cpu_s: float = 0.0
    worker_cpu_s: float = 0.0

    def share(self, min_turn: int = 1) -> float:
        pairs = [(p, c) for p, c, t in zip(self.prompt, self.cached, self.turn) if t >= min_turn]
        total = sum(p for p, _ in pairs)
        return 100.0 * sum(c for _, c in pairs) / total if total else float("nan")

    def ttft_ms(self, q: float) -> float:
        xs = sorted(self.ttft)
        return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000 if xs else float("nan")


async def one_turn(client: aiohttp.ClientSession, url: str, ids: list[int], max_new: int) -> tuple[dict, float, str]:
    """A streamed token-id /generate; returns (last event, TTFT s, worker URL)."""
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new, "temperature": 0}, "stream": True}
    t0 = time.perf_counter()
    ttft = None
    last: Optional[dict] = None
    async with client.post(url + "/generate", json=body, headers={"Authorization": f"Bearer {KEY}"}) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:300]}")
        worker = r.headers.get("x-kvship-worker", "")
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                raise RuntimeError(f"stream error: {event}")
            if ttft is None:
                ttft = time.perf_counter() - t0
            last = event
    if last is None or ttft is None:
        raise RuntimeError("the stream ended without an event")
    return last, ttft, worker


def plan_order(counts: list[int]) -> list[int]:
    """The worker of each conversation under ``--plans`` counts (conversations per worker): round robin over the
    workers with conversations left, so the first turns in flight spread as a router's would."""
    left, order = list(counts), []
    while any(left):
        for w, n in enumerate(left):
            if n:
                order.append(w)
                left[w] -= 1
    return order


async def run_workload(
    router_urls: list[str],
    worker_urls: list[str],
    policy: str,
    args,
    plan: Optional[list[int]] = None,
    pids: tuple[list[int], list[int]] = ([], []),
) -> Result:
    """The workload through the routers, or with ``plan`` (a worker index per conversation) straight to the
    workers: a placement fixed in advance, no router."""
    res = Result(policy)
    rng = random.Random(args.seed)
    systems = [[rng.randrange(LOW, HIGH) for _ in range(args.system_tokens)] for _ in range(args.tenants)]
    # conversation c belongs to tenant c % tenants (its system prompt) and has its own user turns
    conversations = args.tenants * args.sessions
    users = [
        [[rng.randrange(LOW, HIGH) for _ in range(args.user_tokens)] for _ in range(args.turns)]
        for _ in range(conversations)
    ]
    # which router replica each turn goes to (the same for every policy: its own generator)
    pick = random.Random(args.seed + 1000)
    replica = [
        [
            (i + t) % len(router_urls) if args.router_choice == "alternate" else pick.randrange(len(router_urls))
            for t in range(args.turns)
        ]
        for i in range(conversations)
    ]
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as client:
        # one request per worker straight to it: first-forward costs stay out of the measured turns
        warm = [rng.randrange(LOW, HIGH) for _ in range(8)]
        for w in worker_urls:
            body = {"input_ids": warm, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
            async with client.post(w + "/generate", json=body, headers={"Authorization": f"Bearer {KEY}"}) as r:
                assert r.status == 200, await r.text()
        await asyncio.sleep(args.settle_s)  # the router's event feeds load their snapshots
        sem = asyncio.Semaphore(args.concurrency)

        async def tenant(i: int) -> None:
            history = list(systems[i % args.tenants])
            prev_worker = None
            think = random.Random(args.seed * 7919 + i)  # the same pauses for every policy
            for t in range(args.turns):
                if t and args.think_ms > 0:  # the user reads the reply and types (no slot held meanwhile)
                    await asyncio.sleep(args.think_ms * think.uniform(0.5, 1.5) / 1000)
                prompt = history + users[i][t]
                url = router_urls[replica[i][t]] if plan is None else worker_urls[plan[i]]  # replicas behind a Service
                async with sem:
                    try:
                        event, ttft, worker = await one_turn(client, url, prompt, args.max_new_tokens)
                        worker = worker or url
                    except (RuntimeError, aiohttp.ClientError, asyncio.TimeoutError) as e:
                        print(f"{policy}: tenant {i} turn {t + 1}: {e}", file=sys.stderr)
                        res.errors += 1
                        return
                meta = event["meta_info"]
                res.prompt.append(int(meta["prompt_tokens"]))
                res.cached.append(int(meta["cached_tokens"]))
                res.turn.append(t + 1)
                res.ttft.append(ttft)
                if prev_worker is None:
                    res.first[worker] = res.first.get(worker, 0) + 1
                elif worker != prev_worker:
                    res.moves += 1
                prev_worker = worker
                history = prompt + list(event["output_ids"])

        cpu0 = [cpu_seconds(p) for p in pids]
        t0 = time.perf_counter()
        await asyncio.gather(*(tenant(i) for i in range(conversations)))
        res.wall_s = time.perf_counter() - t0
        res.router_cpu_s, res.worker_cpu_s = (cpu_seconds(p) - c for p, c in zip(pids, cpu0))
        for r in router_urls:
            async with client.get(r + "/metrics", headers={"Authorization": f"Bearer {KEY}"}) as resp:
                assert resp.status == 200, await resp.text()
                read_predictions(res, await resp.text())
    return res


def read_predictions(res: Result, text: str) -> None:
    """Add one router's ``kvship_router_kv_*`` prediction series (docs/cache.md) to ``res``."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "kvship_router_kv_predictions_total":
                res.predictions[s.labels["outcome"]] = res.predictions.get(s.labels["outcome"], 0) + int(s.value)
            elif s.name == "kvship_router_kv_actual_cached_tokens_sum":
                res.actual_sum += s.value
            elif s.name == "kvship_router_kv_prediction_error_tokens_sum":
                res.error_sum += s.value
            elif s.name == "kvship_router_kv_predicted_cached_tokens_sum":
                res.predicted_sum += s.value
            elif s.name == "kvship_router_kv_lost_prompts_total":
                res.lost[s.labels["placement"]] = res.lost.get(s.labels["placement"], 0) + int(s.value)


def report(results: list[Result], args, load: tuple[float, float]) -> str:
    by = {r.policy: r for r in results}
    how = (
        "a tenant's turns alternate between them" if args.router_choice == "alternate" else "each turn to one at random"
    )
    lines = [
        f"Machine: {args.machine}; load average {load[0]:.1f} before, {load[1]:.1f} after.",
        f"{args.workers} CPU workers (tiny 2-layer llama), {args.pool_tokens}-token device pool each, page size {PAGE}, "
        f"host tier {args.hicache_ratio:g}x, --enable-kv-events; {args.tenants} tenants x {args.sessions} sessions x {args.turns} turns "
        f"({args.system_tokens} system + {args.user_tokens} user ids per turn, {args.max_new_tokens} new tokens), "
        f"at most {args.concurrency} in flight"
        + (f", {args.think_ms:g} ms think time between turns" if args.think_ms > 0 else "")
        + f"; streamed token-id /generate through {args.routers} router "
        f"replica(s) ({how}); fresh workers per policy.",
        "",
        "| policy | requests | errors | prompt tokens | cached share % | cached share, turns >= 2 % | "
        "TTFT p50 ms | TTFT p90 ms | tenant moved worker | first turns per worker | wall s | CPU s, routers / workers |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.policy} | {len(r.prompt)} | {r.errors} | {sum(r.prompt)} | {r.share():.1f} | {r.share(2):.1f} | "
            f"{r.ttft_ms(0.5):.1f} | {r.ttft_ms(0.9):.1f} | {r.moves} | "
            f"{'/'.join(str(n) for n in sorted(r.first.values(), reverse=True))} | {r.wall_s:.1f} | "
            f"{r.router_cpu_s:.2f} / {r.worker_cpu_s:.2f} |"
        )
    for r in results:
        n = sum(r.predictions.values())
        if n:
            lines.append(
                f"\n{r.policy}: predicted vs actual cached tokens over {n} requests compared: "
                + ", ".join(f"{k} {100 * r.predictions.get(k, 0) / n:.0f}%" for k in ("exact", "under", "over"))
                + f"; mean predicted {r.predicted_sum / max(1, len(r.prompt)):.1f}, mean actual "
                f"{r.actual_sum / n:.1f}, mean |error| {r.error_sum / n:.1f} tokens; returning prompts every "
                f"worker had lost: {r.lost.get('contained', 0)} sent to the pool losing the most pages, "
                f"{r.lost.get('spread', 0)} by the tie rule."
            )
    c = by.get("cache_aware")
    for k in results:
        if c is None or k is c:
            continue
        ratio = c.ttft_ms(0.5) / k.ttft_ms(0.5) if k.ttft else float("nan")
        lines += [
            "",
            f"{k.policy} - cache_aware: cached share {k.share() - c.share():+.1f} points "
            f"(turns >= 2: {k.share(2) - c.share(2):+.1f} points); TTFT p50 cache_aware / {k.policy} = {ratio:.2f} "
            f"(issue goal: +20 points).",
        ]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--pool-tokens", type=int, default=320, help="each worker's --max-total-tokens")
    p.add_argument("--hicache-ratio", type=float, default=1.0, help="host tier size (0: none)")
    p.add_argument("--tenants", type=int, default=12)
    p.add_argument(
        "--sessions",
        type=int,
        default=1,
        help="conversations per tenant: each starts from its tenant's system prompt with its own user turns",
    )
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=96)
    p.add_argument("--user-tokens", type=int, default=24)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=6)
    p.add_argument(
        "--routers",
        type=int,
        default=1,
        help="router replicas (same policy, same workers); turns alternate between them",
    )
    p.add_argument(
        "--router-choice",
        choices=("alternate", "random"),
        default="alternate",
        help="with --routers > 1: a tenant's turns alternate between the replicas, or each goes to one at random",
    )
    p.add_argument(
        "--think-ms",
        type=float,
        default=0.0,
        help="a user's pause between a reply and the next turn (uniform in 0.5-1.5x this, outside the concurrency "
        "limit); 0: the next turn is sent as the reply ends",
    )
    p.add_argument("--settle-s", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=None,
        help="run the whole comparison once per seed (fresh workers each time) and end with the per-seed differences "
        "and their mean (overrides --seed)",
    )
    p.add_argument("--policies", nargs="+", default=["cache_aware", "kv_events"])
    p.add_argument(
        "--kv-events-load-tokens",
        type=float,
        nargs="+",
        default=[],
        help="run kv_events once per value of the router's --kv-events-load-tokens (default: the router's default)",
    )
    # kv_events with one of the router's switches on, off, or once each
    for flag, default, section in (
        ("contain-thrash", "on", "Thrash containment"),
        ("pending", "both", "Pages on their way"),
    ):
        router_flag = "--kv-events-" + flag
        p.add_argument(
            "--" + flag,
            choices=("on", "off", "both"),
            default=default,
            help=f"kv_events with the router's {router_flag} on, off, or once each (docs/cache.md, '{section}')",
        )
    p.add_argument(
        "--plans",
        nargs="+",
        default=[],
        metavar="N,N,...",
        help="also run the workload with each conversation's worker fixed in advance, straight to the workers (no "
        "router): conversations per worker, e.g. 3,3,6 (a placement chosen knowing the whole workload, to "
        "compare the policies with)",
    )
    p.add_argument("--machine", default=f"{os.cpu_count()}-core CPU box ({platform.machine()}), no GPU")
    args = p.parse_args()
    runs: list[tuple[str, str, list[str], Optional[list[int]]]] = []
    switch = {"on": [True], "off": [False], "both": [False, True]}
    contain, pending = switch[args.contain_thrash], switch[args.pending]
    for policy in args.policies:
        if policy != "kv_events":
            runs.append((policy, policy, [], None))
            continue
        loads = [(f"load {v:g}", ["--kv-events-load-tokens", str(v)]) for v in args.kv_events_load_tokens] or [("", [])]
        for on in contain:
            for pend in pending:
                for load_label, load_args in loads:
                    notes = [n for n in (load_label, "" if on else "no containment", "" if pend else "no pending") if n]
                    label = "kv_events" + (f" ({', '.join(notes)})" if notes else "")
                    flags = [
                        "--kv-events-contain-thrash" if on else "--no-kv-events-contain-thrash",
                        "--kv-events-pending" if pend else "--no-kv-events-pending",
                    ]
                    runs.append((label, policy, load_args + flags, None))
    for spec in args.plans:
        counts = [int(n) for n in spec.split(",")]
        if len(counts) != args.workers or sum(counts) != args.tenants * args.sessions or min(counts) < 0:
            p.error(
                f"--plans {spec}: {args.workers} counts adding up to the {args.tenants * args.sessions} conversations"
            )
        runs.append((f"plan {'/'.join(map(str, counts))}", "cache_aware", [], plan_order(counts)))
    by_seed: dict[int, list[Result]] = {}
    with tempfile.TemporaryDirectory(prefix="kvbench-model-") as model_dir:
        build_model(model_dir)
        for seed in args.seeds or [args.seed]:
            args.seed = seed
            load0 = os.getloadavg()[0]
            results = []
            for label, policy, extra, plan in runs:
                with cluster(model_dir, policy, extra, args) as (router_urls, worker_urls, rpids, wpids):
                    results.append(
                        asyncio.run(run_workload(router_urls, worker_urls, label, args, plan, (rpids, wpids)))
                    )
                print(f"seed {seed}, {label}: done in {results[-1].wall_s:.1f} s", file=sys.stderr)
            by_seed[seed] = results
            if args.seeds:
                print(f"\n## seed {seed}\n")
            print(report(results, args, (load0, os.getloadavg()[0])), flush=True)
    if args.seeds:
        print("\n" + seed_summary(by_seed))


def seed_summary(by_seed: dict[int, list[Result]]) -> str:
    """Mean cached share per policy over the seeds, and each policy's per-seed difference from cache_aware."""
    seeds = sorted(by_seed)
    policies = [r.policy for r in by_seed[seeds[0]]]
    share = {p: [next(r for r in by_seed[s] if r.policy == p).share() for s in seeds] for p in policies}
    lines = [
        f"## {len(seeds)} seeds ({', '.join(map(str, seeds))})",
        "",
        "| policy | cached share % per seed | mean | points vs cache_aware per seed | mean points |",
        "|---|---|---|---|---|",
    ]
    base = share.get("cache_aware")
    for p in policies:
        diffs = [a - b for a, b in zip(share[p], base)] if base is not None and p != "cache_aware" else None
        lines.append(
            f"| {p} | {' / '.join(f'{v:.1f}' for v in share[p])} | {statistics.mean(share[p]):.1f} | "
            + (f"{' / '.join(f'{d:+.1f}' for d in diffs)} | {statistics.mean(diffs):+.1f} |" if diffs else "- | - |")
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
