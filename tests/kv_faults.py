"""Test-only KV fault injection: make a prefill ``KVManager`` write a wrong page.

Not product code and not product config: the worker knows nothing of it.  The
fault goes through the transfer backend's public ``write`` of one manager
instance: every ``every``-th KV batch that manager writes reads its first page
from the padding page instead (prefill's own memory is not touched), so a
decode side that asked for a checksum must fail that request with
"checksum mismatch".

Three ways in:

* ``corrupt_kv_every(manager, n)``: one manager in this process;
* ``corrupting_prefill_managers(n)``: a context manager; every prefill manager
  built inside it (in this process) corrupts;
* ``corrupt_kv_env(n)``: environment for a child process tree (``kvship local``
  and its workers): puts ``tests/fault_hooks`` (its ``sitecustomize``) on
  ``PYTHONPATH``, which patches the prefill managers of every process that
  builds one.

Importing this module imports neither torch nor kvship (the hook also loads
into router processes).
"""

from __future__ import annotations

import contextlib
import importlib.abc
import itertools
import logging
import os
import sys
import threading
from typing import Any, Callable, Iterator

logger = logging.getLogger("kv_faults")

ENV_VAR = "TEST_KV_CORRUPT_EVERY"
HOOK_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fault_hooks")
SENDER_MODULE = "kvship.engine.disagg.sender"


def misroute_first_page(descs: Any, page_bytes: int) -> Any:
    """``descs`` with the first page of the first run read from the padding page (source offset 0) instead."""
    import numpy as np

    from kvship.engine.disagg.base import TransferDescs

    first_len = int(descs.length[0])
    head = dict(
        src_region=descs.src_region[:1],
        src_off=np.zeros(1, np.int64),
        dst_region=descs.dst_region[:1],
        dst_off=descs.dst_off[:1],
        length=np.array([page_bytes], np.int64),
    )
    parts = [head]
    if first_len > page_bytes:
        parts.append(
            dict(
                src_region=descs.src_region[:1],
                src_off=descs.src_off[:1] + page_bytes,
                dst_region=descs.dst_region[:1],
                dst_off=descs.dst_off[:1] + page_bytes,
                length=np.array([first_len - page_bytes], np.int64),
            )
        )
    parts.append(
        dict(
            src_region=descs.src_region[1:],
            src_off=descs.src_off[1:],
            dst_region=descs.dst_region[1:],
            dst_off=descs.dst_off[1:],
            length=descs.length[1:],
        )
    )
    return TransferDescs(**{k: np.concatenate([p[k] for p in parts]) for k in head})


def corrupt_kv_every(manager: Any, every: int) -> None:
    """Make prefill ``manager`` misroute one page of every ``every``-th KV batch it writes (aux records pass)."""
    if every < 1:
        return
    backend = manager.backend
    real_write = backend.write
    page_bytes = manager.layout.page_bytes
    aux_region = manager.aux_region
    lock = threading.Lock()
    counter = itertools.count(1)

    def write(peer_id: str, room: int, descs: Any, done: bool = False) -> None:
        if len(descs) and int(descs.src_region.max()) < aux_region:  # a KV batch, not the aux record
            with lock:
                n = next(counter)
            if n % every == 0:
                logger.warning("fault injection: room %d gets a wrong page", room)
                descs = misroute_first_page(descs, page_bytes)
        return real_write(peer_id, room, descs, done)

    backend.write = write


def _patch_prefill_managers(sender_module: Any, every: int) -> Callable[[], None]:
    cls = sender_module.PrefillKVManager
    real_init = cls.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        real_init(self, *args, **kwargs)
        corrupt_kv_every(self, every)

    cls.__init__ = __init__

    def restore() -> None:
        cls.__init__ = real_init

    return restore


@contextlib.contextmanager
def corrupting_prefill_managers(every: int) -> Iterator[None]:
    """Every prefill ``KVManager`` built in this process inside the block corrupts every ``every``-th KV batch."""
    import importlib

    restore = _patch_prefill_managers(importlib.import_module(SENDER_MODULE), every)
    try:
        yield
    finally:
        restore()


def corrupt_kv_env(every: int) -> dict[str, str]:
    """Environment (to add to ``os.environ``) under which child processes' prefill managers corrupt."""
    path = os.pathsep.join(p for p in (HOOK_DIR, os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, ENV_VAR: str(every)}


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Runs ``patch(module)`` right after ``name`` is first imported (no import happens here)."""

    def __init__(self, name: str, patch: Callable[[Any], Any]):
        self.name = name
        self.patch = patch

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                break
        else:
            return None
        sys.meta_path.remove(self)
        real_exec = spec.loader.exec_module
        patch = self.patch

        def exec_module(module: Any) -> None:
            real_exec(module)
            patch(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install_from_env() -> None:
    """``sitecustomize`` entry: with ``$TEST_KV_CORRUPT_EVERY`` = N > 0, patch prefill managers once built."""
    every = int(os.environ.get(ENV_VAR, "0") or 0)
    if every < 1:
        return
    if SENDER_MODULE in sys.modules:
        _patch_prefill_managers(sys.modules[SENDER_MODULE], every)
        return
    sys.meta_path.insert(0, _PatchOnImport(SENDER_MODULE, lambda m: _patch_prefill_managers(m, every)))
