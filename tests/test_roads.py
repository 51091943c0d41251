"""Note [roads]: the router's table, row by row, with no workers; then each road forced
through ``Limits.roads`` on a real handle, moving known bytes."""
import pytest

torch = pytest.importorskip("torch", reason="needs torch (pip install torch)")

from conftest import random_bytes

import nvmeswap
from nvmeswap.io import scheduler as scheduler_module
from nvmeswap.io.limits import Limits
from nvmeswap.io.roads import ALL_ROADS, ALWAYS_OPEN, Facts, Memory, Road, route

KiB, MiB = 1 << 10, 1 << 20
LIMIT = 256 * KiB


def facts(opened=True, is_async=False, is_read=True, nbytes=4 * KiB, aligned=True,
          memory=Memory.LOCKED, busy=False, queue_room=True, conflicts=False,
          staging_room=True, inline_limit=LIMIT, batch=False):
    return Facts(opened, is_async, is_read, nbytes, inline_limit, aligned, memory, busy,
                 queue_room, conflicts, staging_room, batch)


# (facts, roads the handle allows, the road) -- one row per rule and per way to miss it.
TABLE = [
    # Before the file is opened: the quick roads.
    (facts(opened=False), ALL_ROADS, Road.QUICK_SYNC),
    (facts(opened=False, memory=Memory.HOST, is_read=False), ALL_ROADS, Road.QUICK_SYNC),
    (facts(opened=False, busy=True), ALL_ROADS, Road.OPEN),
    (facts(opened=False, aligned=False), ALL_ROADS, Road.OPEN),
    (facts(opened=False, nbytes=LIMIT + 4 * KiB), ALL_ROADS, Road.OPEN),
    (facts(opened=False, memory=Memory.DEVICE), ALL_ROADS, Road.OPEN),
    (facts(opened=False), ALWAYS_OPEN, Road.OPEN),
    (facts(opened=False, is_async=True), ALL_ROADS, Road.QUICK_READ),
    (facts(opened=False, is_async=True, busy=True), ALL_ROADS, Road.QUICK_READ),
    (facts(opened=False, is_async=True, queue_room=False), ALL_ROADS, Road.OPEN),
    (facts(opened=False, is_async=True, memory=Memory.HOST), ALL_ROADS, Road.OPEN),
    (facts(opened=False, is_async=True, is_read=False), ALL_ROADS, Road.OPEN),
    (facts(opened=False, is_async=True), ALL_ROADS - {Road.QUICK_READ}, Road.OPEN),
    # A slice of a batch (Note [batches]).
    (facts(batch=True, is_async=True), ALL_ROADS, Road.BATCH),
    (facts(batch=True, is_async=True, is_read=False, busy=True), ALL_ROADS, Road.BATCH),
    (facts(batch=True, is_async=True, memory=Memory.HOST), ALL_ROADS, Road.EACH),
    (facts(batch=True, is_async=True, aligned=False), ALL_ROADS, Road.EACH),
    (facts(batch=True, is_async=True, nbytes=LIMIT + 4 * KiB), ALL_ROADS, Road.EACH),
    (facts(batch=True, is_async=True, queue_room=False), ALL_ROADS, Road.EACH),
    (facts(batch=True, is_async=True), ALWAYS_OPEN, Road.EACH),
    # Opened and placed.
    (facts(memory=Memory.CUFILE, inline_limit=0), ALL_ROADS, Road.CUFILE),
    (facts(memory=Memory.CUFILE, inline_limit=0), ALWAYS_OPEN, Road.CUFILE),
    (facts(), ALL_ROADS, Road.INLINE),
    (facts(memory=Memory.HOST, aligned=False), ALL_ROADS, Road.INLINE),
    (facts(busy=True), ALL_ROADS, Road.INLINE),         # sync: its caller waits anyway
    (facts(conflicts=True, busy=True), ALL_ROADS, Road.CALLER_QUEUE),
    (facts(conflicts=True, busy=True, queue_room=False), ALL_ROADS, Road.WORKERS),
    (facts(staging_room=False, memory=Memory.HOST), ALL_ROADS, Road.CALLER_QUEUE),
    (facts(is_async=True), ALL_ROADS, Road.CALLER_QUEUE),
    (facts(is_async=True, queue_room=False), ALL_ROADS, Road.INLINE),
    (facts(is_async=True, aligned=False), ALL_ROADS, Road.INLINE),
    (facts(is_async=True, aligned=False, busy=True), ALL_ROADS, Road.WORKERS),
    (facts(is_async=True, queue_room=False, busy=True), ALL_ROADS, Road.WORKERS),
    (facts(is_async=True), ALL_ROADS - {Road.CALLER_QUEUE}, Road.INLINE),
    (facts(), ALL_ROADS - {Road.INLINE}, Road.CALLER_QUEUE),
    (facts(), ALWAYS_OPEN, Road.WORKERS),
    (facts(nbytes=LIMIT + 4 * KiB), ALL_ROADS, Road.WORKERS),
    (facts(nbytes=LIMIT + 4 * KiB, is_async=True), ALL_ROADS, Road.WORKERS),
    (facts(memory=Memory.DEVICE), ALL_ROADS, Road.INLINE),     # staged through host memory
    (facts(nbytes=0), ALL_ROADS, Road.WORKERS),
]


@pytest.mark.parametrize("row, roads, expected", TABLE,
                         ids=[f"{i}-{expected.name}" for i, (_, _, expected) in enumerate(TABLE)])
def test_route(row, roads, expected):
    assert route(row, roads) is expected


def test_limits_are_checked():
    with pytest.raises(ValueError, match="staging_bytes"):
        Limits(staging_bytes=-1)
    with pytest.raises(ValueError, match="inline_bytes"):
        Limits(inline_bytes=True)
    with pytest.raises(TypeError, match="roads"):
        Limits(roads={Road.INLINE})
    with pytest.raises(TypeError, match="_limits"):
        nvmeswap.aio_handle(_limits={"staging_bytes": 1})
    assert Limits().replace(min_chunk=4096).min_chunk == 4096


@pytest.fixture
def roads_taken(monkeypatch):
    """Every road the router gave, in order (a spy: nothing is changed)."""
    taken = []

    def spy(facts, roads):
        road = route(facts, roads)
        taken.append(road)
        return road

    monkeypatch.setattr(scheduler_module, "route", spy)
    return taken


# Operations that, between them, can take every host road.
OPERATIONS = [  # (locked memory, is_async, nbytes, file offset)
    (True, False, 4 * KiB, 0), (False, False, 4 * KiB + 1, 3), (True, True, 64 * KiB, 8 * KiB),
    (False, True, 8 * KiB, 4 * KiB), (True, False, 3 * MiB, 4 * KiB), (False, True, MiB + 5, 7),
]


@pytest.mark.parametrize("road", [Road.QUICK_SYNC, Road.QUICK_READ, Road.INLINE,
                                  Road.CALLER_QUEUE, Road.WORKERS])
def test_each_road_forced_moves_the_right_bytes(handle_factory, tmp_path, roads_taken, road):
    """With only ``road`` open beside the workers', reads and writes of every kind give
    back exactly the bytes written, and ``road`` is taken where its rule holds."""
    h = handle_factory(intra_op_parallelism=2, _limits=Limits(roads=ALWAYS_OPEN | {road}))
    path = tmp_path / "f"
    path.write_bytes(random_bytes(4 * MiB, seed=1))
    h.sync_pread(torch.empty(MiB, dtype=torch.uint8), path)      # workers and queue up
    example = torch.empty(0, dtype=torch.uint8)
    for k, (locked, is_async, nbytes, offset) in enumerate(OPERATIONS):
        data = random_bytes(nbytes, seed=10 + k)
        source = h.new_cpu_locked_tensor(nbytes, example) if locked else torch.empty(
            nbytes, dtype=torch.uint8)
        back = h.new_cpu_locked_tensor(nbytes, example) if locked else torch.zeros(
            nbytes, dtype=torch.uint8)
        source.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        if is_async:
            h.async_pwrite(source, str(path), offset)
            assert h.wait() == 1
            h.async_pread(back, str(path), offset)
            assert h.wait() == 1
        else:
            assert h.sync_pwrite(source, str(path), offset) == 1
            assert h.sync_pread(back, str(path), offset) == 1
        assert bytes(back.numpy()) == data, (k, road)
        with open(path, "rb") as f:
            f.seek(offset)
            assert f.read(nbytes) == data
    assert road in roads_taken
    assert set(roads_taken) <= ALWAYS_OPEN | {road}
