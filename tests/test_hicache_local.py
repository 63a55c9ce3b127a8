"""``kvship local --hicache-storage mooncake`` starts the Mooncake Store master itself (docs/cache.md,
"Mooncake Store"); skipped with the reason where the ``mooncake`` package ships no ``mooncake_master``."""

from __future__ import annotations

import time

import pytest
from pd_fixtures import pid_alive, start_local, stop_local

from kvship.app.mooncake_master import mooncake_master_binary


def _master_or_skip() -> str:
    try:
        from mooncake.store import MooncakeDistributedStore  # noqa: F401

        return mooncake_master_binary()
    except (ImportError, OSError, RuntimeError) as e:
        pytest.skip(f"no Mooncake Store here: {e}")


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def _cmdline(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return [a.decode() for a in f.read().split(b"\0") if a]


@pytest.mark.timeout(240)
def test_kvship_local_starts_a_mooncake_master_its_workers_use_and_stops_it(tiny_llama_dir):
    _master_or_skip()
    args = ["--device", "cpu", "--model-path", tiny_llama_dir, "--page-size", "4"]
    args += ["--hicache-storage", "mooncake", "--hicache-storage-size-gb", "0.03"]
    with start_local(args) as cluster:
        children = _children(cluster.proc.pid)
        masters = [p for p in children if _cmdline(p)[0].endswith("mooncake_master")]
        assert len(masters) == 1, [_cmdline(p)[:3] for p in children]
        rpc = next(a.split("=", 1)[1] for a in _cmdline(masters[0]) if a.startswith("--rpc_port="))
        import psutil

        listening = [c.laddr for c in psutil.Process(masters[0]).net_connections("inet") if c.status == "LISTEN"]
        assert listening and all(a.ip == "127.0.0.1" for a in listening), listening  # loopback only
        for url in cluster.workers("prefill") + cluster.workers("decode"):
            argv = _cmdline(cluster.pid(url))
            assert argv[argv.index("--hicache-storage-master") + 1] == f"127.0.0.1:{rpc}"
            assert argv[argv.index("--hicache-storage-metadata") + 1] == "P2PHANDSHAKE"
            assert cluster.info(url)["storage_backend"] == "mooncake"
        r = cluster.generate(list(range(10, 70)), max_new=4)
        assert r.status_code == 200, r.text
        assert stop_local(cluster.proc) == 0, cluster.log("local")
        deadline = time.monotonic() + 10
        while any(pid_alive(p) for p in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(pid_alive(p) for p in children), "children (the master too) outlived kvship local"
