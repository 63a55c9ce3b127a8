"""Picking a TCP port for a process to bind later (``kvship local``'s workers, tensor-parallel rendezvous)."""

from __future__ import annotations

import random
import socket


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for ports it assigns itself (bind to 0, outgoing connections)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(v) for v in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


# Mooncake's transfer engine binds its RPC and TCP-transport listeners to ports it picks at random in
# this range (docs/pd.md, "Ports"); ports picked for our own processes stay out of it.
MOONCAKE_PORTS = range(15000, 17000)


def free_port(host: str = "127.0.0.1") -> int:
    """A free port for a child to bind later, picked below the kernel's ephemeral range where one is free:
    between our check and the child's bind, a port the kernel hands out on its own (a connection's local
    port, another process's bind to 0) can take an ephemeral port, never one below the range; nor
    one in ``MOONCAKE_PORTS``, where a Mooncake transfer engine starting meanwhile may take it."""
    lo, _ = _ephemeral_range()
    if lo > 11000:
        rng = random.Random()
        for _ in range(50):
            port = rng.randrange(10000, lo - 1000)
            if port in MOONCAKE_PORTS:
                continue
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
