"""``nvmeswap tune --pattern rand``: the engine and batch size for small random reads.

Each engine (kernel AIO, and io_uring where it works) reads ``--ops`` requests of
``--io-size`` at random aligned offsets of a ``--file-size`` file into locked memory,
started one call each (batch 1, waited for every 256) and in batches of 16, 64 and 256
(``async_pread_many``, waited for per batch), as ``nvmeswap bench --pattern rand
--batch N`` does. Every configuration is measured ``--loops`` times on one handle per
engine, the configurations interleaved loop by loop so that a drift of the machine
touches them all alike; the best median wins.
"""
import os
import statistics
import tempfile
import time

from .bench_ranks import RANDOM_WAIT_EVERY, fill, make_file, random_loop

BATCHES = (1, 16, 64, 256)


def buffer_bytes(io_size):
    """The locked buffer each engine's measurement holds."""
    return io_size * max(RANDOM_WAIT_EVERY, *BATCHES)


def measure(folder, io_size, file_size, ops, loops, engines, stop):
    """``{(engine, batch): [reads per second, one per loop]}`` for every configuration
    (fewer loops if ``stop``, an Event, is set meanwhile)."""
    import numpy
    import torch

    from ..aio import aio_handle
    rates = {(engine, batch): [] for engine in engines for batch in BATCHES}
    scratch = tempfile.mkdtemp(prefix="nvmeswap-tune-", dir=folder)
    path = os.path.join(scratch, "random.bin")
    handles = {}      # engine -> (handle, locked buffer)
    try:
        for engine in engines:
            handle = aio_handle(engine=engine)
            handles[engine] = (handle, None)
            buffer = handle.new_cpu_locked_tensor(buffer_bytes(io_size),
                                                  torch.empty(0, dtype=torch.uint8))
            handles[engine] = (handle, buffer)
        first_handle, first_buffer = handles[engines[0]]
        fill(first_buffer)
        make_file(first_handle, first_buffer, path, file_size)
        rng = numpy.random.default_rng(0)
        for _ in range(loops):
            for (engine, batch), seen in rates.items():
                if stop.is_set():
                    return rates
                handle, buffer = handles[engine]
                plan = {"io_size": io_size, "batch": 0 if batch == 1 else batch,
                        "file_size": file_size, "ops": ops}
                started = time.perf_counter()
                random_loop(handle, "read", buffer, path, plan, rng)
                seen.append(ops / (time.perf_counter() - started))
        return rates
    finally:
        for handle, _ in handles.values():
            handle.close()
        if os.path.exists(path):
            os.unlink(path)
        os.rmdir(scratch)


def result(rates, io_size, file_size, ops, engines, seconds, interrupted):
    """The JSON record: every configuration's median, and the best of them."""
    measured = [{"engine": engine, "batch": batch, "reads_per_s": statistics.median(seen),
                 "loops": len(seen)}
                for (engine, batch), seen in rates.items() if seen]
    best = max(measured, key=lambda m: m["reads_per_s"], default=None)
    return {"pattern": "rand", "best": best, "io_size": io_size, "file_size": file_size,
            "ops": ops, "engines": list(engines), "seconds": seconds,
            "interrupted": interrupted, "measurements": measured,
            "units": {"reads_per_s": "reads per second", "io_size": "bytes"}}
