"""``kvship serve --nnodes N --node-rank R`` with R > 0: a node that runs ranks only.

Node 0 rank 0 owns HTTP, the tokenizer and the inbox every rank follows.  On
another node ``kvship serve`` is a launcher: it checks that node 0's
rendezvous (``--dist-init-addr``) accepts connections within
``--dist-init-timeout`` seconds (else it exits 1 with one line), spawns the
node's ranks (``RankProcesses``), answers ``GET /health`` on ``--host:--port``
with their state (200 while every rank is alive, else 503), and exits:

* 0 when every rank exited 0 (node 0 told them to stop), or after
  SIGINT/SIGTERM (its ranks are killed; node 0 then loses them and exits 1);
* 1 as soon as one rank exits otherwise: a rank whose collective failed (node
  0 or another node died: gloo notices a closed socket at once, otherwise
  after ``--dist-timeout``) exits 1, and the launcher kills the rest.

Its ranks exit by themselves when the launcher disappears.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any, Callable

from kvship.engine.config import ServerArgs
from kvship.engine.distributed.topology import Topology

logger = logging.getLogger("kvship.node")

POLL_S = 0.2
HEALTH_TIMEOUT_S = 5.0


def _health_server(server_args: ServerArgs, state: Callable[[], tuple[int, dict]]) -> HTTPServer:
    """``GET /health`` only, open like a worker's (kubelet probes; docs/security.md): one connection at a time,
    each with ``HEALTH_TIMEOUT_S`` to send its request line and headers (http.server caps a line at 64 KiB and
    the headers at 100), no body read; a slow or silent peer costs at most that long."""

    class Handler(BaseHTTPRequestHandler):
        timeout = HEALTH_TIMEOUT_S  # per connection socket timeout

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path.split("?")[0] not in ("/health", "/health_generate"):
                self.send_error(404)
                return
            code, body = state()
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet
            pass

    server = HTTPServer((server_args.host, server_args.port), Handler)
    threading.Thread(target=server.serve_forever, name="kvship-node-health", daemon=True).start()
    return server


def run_node(server_args: ServerArgs, topology: Topology, rank_main: Callable[..., None]) -> int:
    """The launcher of node ``topology.node_rank`` > 0 (module docstring); returns the exit status."""
    from kvship.engine.distributed.groups import init_method
    from kvship.engine.distributed.launch import RankProcesses, wait_for_rendezvous

    host, port = topology.init_host_port  # type: ignore[misc] - a node > 0 always has one
    try:
        wait_for_rendezvous(host, port, server_args.dist_init_timeout)
    except ConnectionError as e:
        logger.error("%s", e)
        return 1
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    ranks = RankProcesses.start(rank_main, server_args, topology, init_method(topology))

    def state() -> tuple[int, dict]:
        states = ranks.states()
        ok = all(s["alive"] for s in states)
        body = {"status": "ok" if ok else "unhealthy", "node_rank": topology.node_rank, "ranks": states}
        return (200 if ok else 503), body

    try:
        server = _health_server(server_args, state)
    except OSError as e:
        logger.error("cannot listen on %s:%d: %s", server_args.host, server_args.port, e)
        ranks.stop(0.0)
        return 1
    logger.info(
        "node %d of %d: ranks %s, /health on %s:%d",
        topology.node_rank,
        topology.nnodes,
        list(topology.node_ranks),
        server_args.host,
        server_args.port,
    )
    try:
        while not stop.wait(POLL_S):
            codes = [p.exitcode for p in ranks.procs.values()]
            if any(c not in (None, 0) for c in codes):
                logger.error("%s: shutting node %d down", ranks.failure(), topology.node_rank)
                return 1
            if all(c == 0 for c in codes):
                logger.info("node %d: every rank stopped", topology.node_rank)
                return 0
        logger.info("node %d: stopping its ranks", topology.node_rank)
        return 0
    finally:
        ranks.stop(0.0)  # kills what is left
        server.shutdown()
