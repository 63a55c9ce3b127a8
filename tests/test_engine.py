"""``Engine``: the scheduler thread bridged to asyncio (in-process, tiny random Llama)."""

from __future__ import annotations

import asyncio

import pytest

from kvship.engine.config import ServerArgs
from kvship.engine.engine import Engine, EngineDead, EngineOverloaded
from kvship.engine.io_struct import GenerateRequest, SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    e = Engine(
        ServerArgs(model_path=tiny_llama_dir, max_total_tokens=2048, max_running_requests=4, max_queued_requests=2)
    )
    yield e
    e.shutdown()


def req(rid: str, n: int = 5, **sp) -> GenerateRequest:
    return GenerateRequest(
        rid=rid,
        input_ids=[5, 6, 7, 8],
        sampling_params=SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True, **sp),
    )


async def wait_idle(engine: Engine) -> dict:
    for _ in range(1000):
        s = engine.get_stats()
        if s["running"] == 0 and s["waiting"] == 0 and engine.num_active() == 0:
            return s
        await asyncio.sleep(0.01)
    raise AssertionError(engine.get_stats())


def test_generate_yields_chunks_until_exactly_one_finished(engine):
    async def main():
        chunks = [c async for c in engine.generate(req("g1", 6))]
        assert [c.finished for c in chunks].count(True) == 1 and chunks[-1].finished
        assert sum(len(c.token_ids) for c in chunks) == 6
        assert chunks[-1].finish_reason == {"type": "length", "length": 6}
        assert chunks[-1].completion_tokens == 6 and chunks[-1].prompt_tokens == 4

    asyncio.run(main())


def test_generate_text_matches_decode_of_the_tokens(engine):
    async def main():
        deltas = [d async for d in engine.generate_text(req("t1", 12))]
        ids = [t for d in deltas for t in d.token_ids]
        assert "".join(d.text for d in deltas) == engine.tokenizer.decode(ids)
        assert deltas[-1].finished and deltas[-1].finish_reason == "length"

    asyncio.run(main())


def test_closing_the_stream_early_aborts_and_frees_slots(engine):
    async def main():
        agen = engine.generate(req("early", 1500))
        first = await agen.__anext__()
        assert not first.finished
        await agen.aclose()
        stats = await wait_idle(engine)
        assert stats["free_slots"] == stats["total_slots"]
        assert not engine.has_request("early")

    asyncio.run(main())


def test_abort_by_rid_finishes_the_request_with_abort(engine):
    async def main():
        chunks = []
        async for c in engine.generate(req("ab", 1500)):
            chunks.append(c)
            if len(chunks) == 1:
                assert engine.abort("ab") is True
        assert chunks[-1].finish_reason["type"] == "abort"
        assert engine.abort("ab") is False

    asyncio.run(main())


def test_open_refuses_more_than_the_queue_holds(engine):
    async def main():
        handles = engine.open([req(f"q{i}", 1500) for i in range(2)])
        with pytest.raises(EngineOverloaded):
            engine.open([req("q-extra", 3)])
        with pytest.raises(ValueError):
            engine.open([req("q0", 3)])  # rid already running
        for h in handles:
            h.close()
        await wait_idle(engine)
        chunks = [c async for c in engine.generate(req("after", 2))]
        assert chunks[-1].finished

    asyncio.run(main())


def test_shutdown_finishes_open_requests_and_refuses_new_ones(tiny_llama_dir):
    e = Engine(ServerArgs(model_path=tiny_llama_dir, max_total_tokens=1024))

    async def main():
        agen = e.generate(req("s1", 1500))
        await agen.__anext__()
        await asyncio.to_thread(e.shutdown)
        rest = [c async for c in agen]
        assert rest[-1].finished and rest[-1].finish_reason["type"] == "abort"
        assert not e.is_alive()
        with pytest.raises(EngineDead):
            e.open([req("s2", 1)])

    asyncio.run(main())
