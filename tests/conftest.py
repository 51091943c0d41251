import gc
import os

import psutil
import pytest

import nvmeswap


def _resources():
    gc.collect()
    with open("/proc/self/maps") as maps:
        shared = sum("memfd:nvmeswap" in line for line in maps)
    return {
        "child processes": sorted(p.pid for p in psutil.Process().children(recursive=True)),
        "file descriptors": sorted(os.listdir("/proc/self/fd")),
        "shared mappings": shared,
        "/dev/shm entries": sorted(os.listdir("/dev/shm")),
    }


@pytest.fixture(autouse=True)
def no_leaks():
    """Nothing a test starts may outlive it: processes, descriptors, shared memory."""
    before = _resources()
    yield
    after = _resources()
    leaked = {k: (before[k], after[k]) for k in before if before[k] != after[k]}
    assert not leaked, f"leaked: {leaked}"


@pytest.fixture
def handle_factory():
    """Make handles that are closed at the end of the test, whatever happens."""
    made = []

    def make(**kwargs):
        made.append(nvmeswap.aio_handle(**kwargs))
        return made[-1]

    yield make
    for handle in made:
        handle.close()


@pytest.fixture
def handle(handle_factory):
    return handle_factory()


def random_bytes(n, seed=0):
    import numpy as np
    return np.random.default_rng(seed + n).integers(0, 256, n, dtype=np.uint8).tobytes()
