"""The ranks of ``nvmeswap bench``: processes that time their loops behind one barrier.

Each rank has its own handle, buffer and file. Per timed loop it records the operation's
seconds ("task") and the operation's and the barrier's ("e2e"), as ds_io times them; a
Ctrl-C stops every rank after the loop in hand.
"""
import multiprocessing
import os
import queue
import signal
import sys
import threading
import time
import warnings

from ..errors import MemoryLockWarning
from ..units import GB, format_size

# Random requests started one call each are waited for this many at a time.
RANDOM_WAIT_EVERY = 256


def run_ranks(plan, stop):
    """Every rank's result, in rank order; one rank runs in this process."""
    if plan["ranks"] == 1:
        return [_rank_job(0, plan, None, stop.event)]
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(plan["ranks"])
    rank_stop = context.Event()
    results = context.Queue()
    ranks = [context.Process(target=_rank_main,
                             args=(rank, {**plan, "progress": plan["progress"] and rank == 0},
                                   barrier, rank_stop, results))
             for rank in range(plan["ranks"])]
    # Started with SIGINT blocked (the mask is inherited): a Ctrl-C while a rank is still
    # starting must not kill it before it ignores SIGINT; the parent decides, below.
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        for process in ranks:
            process.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    collected = []
    try:
        while len(collected) < len(ranks):
            if stop.event.is_set() and not rank_stop.is_set():
                rank_stop.set()
                barrier.abort()          # ranks waiting at the barrier stop there
            try:
                collected.append(results.get(timeout=0.1))
            except queue.Empty:
                if not any(p.is_alive() for p in ranks) and results.empty():
                    raise RuntimeError("a rank process died without a result") from None
    finally:
        for process in ranks:
            process.join(30)
            if process.is_alive():
                process.kill()
                process.join()
    failures = [r["error"] for r in collected if "error" in r]
    if failures:
        raise RuntimeError(failures[0])
    return sorted(collected, key=lambda r: r["rank"])


def _rank_main(rank, plan, barrier, stop, results):
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # the parent decides; see run_ranks
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    try:
        results.put(_rank_job(rank, plan, barrier, stop))
    except BaseException as error:
        barrier.abort()
        results.put({"rank": rank, "error": f"rank {rank}: {type(error).__name__}: {error}"})


def _rank_job(rank, plan, barrier, stop):
    """One rank: its own handle, buffer and file; per timed loop, the operation's seconds
    ("task") and the operation's and the barrier's ("e2e"), as ds_io times them."""
    from ..aio import aio_handle
    from ..gds import gds_handle

    folder = plan["folders"][rank % len(plan["folders"])]
    path = os.path.join(folder, f"nvmeswap-bench-rank{rank}.bin")
    result = {"rank": rank, "file": path, "jobs": {}, "page_locked": None}
    make_handle = gds_handle if plan["buffer"] == "cuda-pinned" else aio_handle
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", MemoryLockWarning)
        handle = make_handle(**plan["handle"])
        with handle:
            result["settings"] = {"block_size": handle.get_block_size(),
                                  "queue_depth": handle.get_queue_depth(),
                                  "single_submit": handle.get_single_submit(),
                                  "overlap_events": handle.get_overlap_events(),
                                  "intra_op_parallelism": handle.get_intra_op_parallelism(),
                                  "engine": handle.get_engine()}
            buffer = _make_buffer(handle, plan["buffer"], buffer_bytes(plan), rank)
            fill(buffer)
            try:
                if plan["pattern"] == "rand":
                    make_file(handle, buffer, path, plan["file_size"])
                elif "write" not in plan["jobs"]:
                    handle.sync_pwrite(buffer, path)         # something to read
                for job in plan["jobs"]:
                    if stop.is_set():
                        break
                    result["jobs"][job] = _timed_loops(handle, job, buffer, path, plan,
                                                       barrier, stop)
            finally:
                if os.path.exists(path):
                    os.unlink(path)
        result["page_locked"] = not any(issubclass(w.category, MemoryLockWarning)
                                        for w in caught)
    for w in caught:
        if not issubclass(w.category, MemoryLockWarning):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return result


def buffer_bytes(plan):
    """The memory one rank moves its data from and to."""
    if plan["pattern"] == "rand":
        return plan["io_size"] * (plan["batch"] or RANDOM_WAIT_EVERY)
    return plan["io_size"]


def make_file(handle, buffer, path, size):
    """A file of ``size`` bytes for random requests to fall in, written with ``buffer``."""
    view = buffer.reshape(-1)       # a tensor or a numpy array (whose view() wants a dtype)
    for start in range(0, size, len(view)):
        piece = view[: min(size - start, len(view))]
        handle.sync_pwrite(piece, path, start)


def random_loop(handle, job, buffer, path, plan, rng):
    """One timed loop of --pattern rand: ``ops`` requests at random aligned offsets."""
    io_size, batch, blocks = plan["io_size"], plan["batch"], plan["file_size"] // plan["io_size"]
    if batch and job == "write":    # a batch's writes may not overlap (Note [batches])
        offsets = [int(block) * io_size for first in range(0, plan["ops"], batch)
                   for block in rng.choice(blocks, min(batch, plan["ops"] - first),
                                           replace=False)]
    else:
        offsets = (rng.integers(0, blocks, plan["ops"]) * io_size).tolist()
    if batch:
        many = handle.async_pread_many if job == "read" else handle.async_pwrite_many
        for first in range(0, len(offsets), batch):
            part = offsets[first:first + batch]
            many(buffer, path, part, lengths=[io_size] * len(part))
            handle.wait()
        return
    single = handle.async_pread if job == "read" else handle.async_pwrite
    views = [buffer[k * io_size:(k + 1) * io_size] for k in range(RANDOM_WAIT_EVERY)]
    for first in range(0, len(offsets), RANDOM_WAIT_EVERY):
        for view, offset in zip(views, offsets[first:first + RANDOM_WAIT_EVERY]):
            single(view, path, offset)
        handle.wait()


def _timed_loops(handle, job, buffer, path, plan, barrier, stop):
    import numpy
    import psutil

    operation = handle.pread if job == "read" else handle.pwrite
    rng = numpy.random.default_rng(len(job))

    def call():
        try:
            if plan["pattern"] == "rand":
                random_loop(handle, job, buffer, path, plan, rng)
            else:
                operation(buffer, path, plan["validate"], False, 0)
        except (OSError, RuntimeError):
            # A Ctrl-C also reaches worker processes still starting; then the stop counts.
            if stop.is_set():
                return False
            raise
        return True

    def barrier_wait():
        """False when Ctrl-C broke the barrier (the loop in hand is not whole)."""
        if barrier is None:
            return True
        try:
            barrier.wait()
        except threading.BrokenBarrierError:
            if stop.is_set():
                return False
            raise
        return True

    for _ in range(plan["warmup_loops"]):
        if stop.is_set() or not call():
            break
    # Ranks start the timed loops together, whatever their set-up and warm-up took.
    if stop.is_set() or not barrier_wait():
        return {"task_seconds": [], "e2e_seconds": [], "cpu_seconds": 0.0}
    progress = _progress_bar(job, plan)
    task, e2e = [], []
    cpu_before = _cpu_seconds(psutil.Process())
    try:
        for _ in range(plan["loops"]):
            if stop.is_set():
                break
            started = time.perf_counter()
            if not call():
                break
            done = time.perf_counter()
            if not barrier_wait():
                break
            task.append(done - started)
            e2e.append(time.perf_counter() - started)
            if progress is not None:
                progress.set_postfix_str(f"{plan['io_size'] / task[-1] / GB:.2f} GB/s")
                progress.update(1)
    finally:
        if progress is not None:
            progress.close()
    return {"task_seconds": task, "e2e_seconds": e2e,
            "cpu_seconds": _cpu_seconds(psutil.Process()) - cpu_before}


def _progress_bar(job, plan):
    """A tqdm bar on a terminal; nothing when standard error is a pipe or a file."""
    if not plan["progress"]:
        return None
    from tqdm import tqdm
    return tqdm(total=plan["loops"], desc=f"{job} {format_size(plan['io_size'])}",
                unit="loop", file=sys.stderr, leave=False, dynamic_ncols=True)


def _make_buffer(handle, kind, nbytes, rank):
    if kind == "numpy":
        import numpy
        return numpy.empty(nbytes, dtype=numpy.uint8)
    import torch
    if kind.startswith("cuda"):
        device = torch.device("cuda", rank % torch.cuda.device_count())
        if kind == "cuda-pinned":
            return handle.new_pinned_device_tensor(nbytes, torch.empty(0, dtype=torch.uint8,
                                                                       device=device))
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    if kind == "locked":
        return handle.new_cpu_locked_tensor(nbytes, torch.empty(0, dtype=torch.uint8))
    if kind == "pinned":
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    return torch.empty(nbytes, dtype=torch.uint8)


def fill(buffer):
    """Random bytes (a repeated 1 MiB pattern), so that nothing compresses or dedupes."""
    import numpy
    if not isinstance(buffer, numpy.ndarray) and buffer.is_cuda:
        import torch
        pattern = torch.frombuffer(bytearray(os.urandom(1 << 20)), dtype=torch.uint8)
        for start in range(0, buffer.numel(), pattern.numel()):
            piece = buffer[start:start + pattern.numel()]
            piece.copy_(pattern[: piece.numel()])
        return
    view = buffer if isinstance(buffer, numpy.ndarray) else buffer.numpy()
    pattern = numpy.frombuffer(os.urandom(1 << 20), dtype=numpy.uint8)
    for start in range(0, view.size, pattern.size):
        view[start:start + pattern.size] = pattern[: view.size - start]


def _cpu_seconds(process):
    """CPU time of this process and its live children (the workers)."""
    total = 0.0
    for p in [process, *process.children(recursive=True)]:
        try:
            times = p.cpu_times()
            total += times.user + times.system
        except Exception:
            pass
    return total
