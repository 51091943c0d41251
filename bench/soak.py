"""Soak: mixed random traffic with faults injected; nothing lost, nothing leaked.

    python bench/soak.py --folder /nvme/scratch --minutes 10 [--small-folder /mnt/small]

Random reads and writes (sizes 1 B to 4 MiB, any offset, sync and async, locked and
plain buffers) against a model of the files, checking every byte read. Faults:
- every few seconds a worker is killed with SIGKILL: the operations it had fail with
  WorkerDied and are written again, the handle recovers;
- every few seconds a Ctrl-C (SIGINT) arrives during an operation: the
  KeyboardInterrupt is caught, an interrupted write is written again (it may still be
  running: the second one is ordered after it), an interrupted wait() waited again;
- with ``--small-folder`` (a small filesystem, e.g. ``mount -t tmpfs -o size=64m``),
  a share of the writes go to files there until the disk is full: a write that gets
  ENOSPC must name its file and leave the file's bytes and the disk's free space as
  they were; files there are deleted when the disk is full.
Every 30 s it prints operations, faults, bytes verified, and the process's RSS,
descriptors and shared mappings, which must stay flat; at the end it checks that
nothing is left once the handle is closed.
"""
import argparse
import errno
import os
import random
import signal
import threading
import time

import numpy as np
import psutil
import torch

import nvmeswap

FILE_LIMIT = 64 << 20     # files stop growing here, so the models' memory stays flat


def shared_mappings():
    with open("/proc/self/maps") as maps:
        return sum("memfd:nvmeswap" in line for line in maps)


def snapshot(process):
    return {"rss_mib": process.memory_info().rss >> 20, "fds": process.num_fds(),
            "children": len(process.children()), "shared_mappings": shared_mappings()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", default="nvmeswap-bench-data")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--kill-every", type=float, default=5.0, help="seconds between kills")
    parser.add_argument("--interrupt-every", type=float, default=3.0,
                        help="seconds between Ctrl-Cs")
    parser.add_argument("--small-folder", help="a folder on a small filesystem to fill up")
    parser.add_argument("--seed", type=int, default=0)
    arguments = parser.parse_args()
    os.makedirs(arguments.folder, exist_ok=True)
    rng = np.random.default_rng(arguments.seed)
    me = psutil.Process()
    before = snapshot(me)
    paths = [os.path.join(arguments.folder, f"soak{i}.bin") for i in range(4)]
    models = [bytearray() for _ in paths]
    small_paths = [os.path.join(arguments.small_folder, f"full{i}.bin") for i in range(4)] \
        if arguments.small_folder else []
    for path in small_paths:
        open(path, "wb").close()
    paths += small_paths
    models += [bytearray() for _ in small_paths]
    counts = {"operations": 0, "faults injected": 0, "operations failed by a fault": 0,
              "Ctrl-Cs injected": 0, "operations interrupted": 0, "full-disk refusals": 0,
              "bytes verified": 0}
    # Started in the background by a shell, SIGINT arrives ignored: the injected
    # Ctrl-Cs must raise KeyboardInterrupt as a terminal's would.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    interrupts = Interrupter(arguments.interrupt_every, rng)
    started = last_kill = last_report = time.monotonic()
    deadline = started + arguments.minutes * 60
    with nvmeswap.aio_handle(intra_op_parallelism=2, overlap_events=True) as h:
        locked = h.new_cpu_locked_tensor(4 << 20, torch.empty(0, dtype=torch.uint8))
        while time.monotonic() < deadline:
            i = int(rng.integers(len(paths)))
            model = models[i]
            size = int(rng.integers(1, 4 << 20))
            buffer = locked[:size] if rng.random() < 0.5 else torch.empty(size, dtype=torch.uint8)
            if small_paths and rng.random() < 0.25:
                i = len(paths) - len(small_paths) + int(rng.integers(len(small_paths)))
                model = models[i]
            if len(model) >= size and rng.random() < 0.5:
                offset = int(rng.integers(0, len(model) - size + 1))
                done = _attempt(counts, h, interrupts, h.sync_pread, buffer, paths[i], offset)
                if done:
                    assert buffer.numpy().tobytes() == model[offset:offset + size], "corrupt read"
                    counts["bytes verified"] += size
            else:
                offset = int(rng.integers(0, min(len(model) + 65536, FILE_LIMIT - size) + 1))
                data = rng.integers(0, 256, size, dtype=np.uint8)
                buffer.numpy()[:] = data
                use_async = rng.random() < 0.5
                free = _free(paths[i])
                try:
                    while not _attempt(counts, h, interrupts, _write, h, buffer, paths[i], offset,
                                       use_async):
                        pass    # failed with its worker, or interrupted: written again
                except OSError as error:
                    if error.errno != errno.ENOSPC or i < len(paths) - len(small_paths):
                        raise
                    _check_refused(error, paths[i], model, free, offset, data, counts)
                    _make_room(paths, models, len(small_paths))
                    continue
                model.extend(bytes(max(0, offset + size - len(model))))
                model[offset:offset + size] = data.tobytes()
            counts["operations"] += 1
            now = time.monotonic()
            if now - last_kill > arguments.kill_every:
                workers = me.children()
                if workers:
                    random.choice(workers).send_signal(signal.SIGKILL)
                    counts["faults injected"] += 1
                last_kill = now
            if now - last_report > 30:
                print(f"{now - started:6.0f} s  {counts}  {snapshot(me)}", flush=True)
                last_report = now
        for path, model in zip(paths, models):
            with open(path, "rb") as f:
                assert f.read() == model, f"{path} differs from its model"
            counts["bytes verified"] += len(model)
        locked = buffer = None     # the locked memory goes with its last tensor
    interrupts.stop()

    after = snapshot(me)
    for path in paths:
        os.unlink(path)
    leaks = {k: (before[k], after[k]) for k in ("children", "shared_mappings", "fds")
             if after[k] != before[k]}
    print(f"done: {counts}")
    print(f"before: {before}  after close: {after}  leaks: {leaks or 0}")


def _write(h, buffer, path, offset, use_async):
    if use_async:
        h.async_pwrite(buffer, path, offset)
        while True:
            try:
                h.wait()
                return
            except KeyboardInterrupt:     # the operation is still the handle's: wait again
                pass
    else:
        h.sync_pwrite(buffer, path, offset)


def _attempt(counts, h, interrupts, operation, *args):
    """True if ``operation`` completed; False if a fault stopped it (it is done again)."""
    try:
        with interrupts.armed(counts):
            operation(*args)
        return True
    except nvmeswap.WorkerDied:
        counts["operations failed by a fault"] += 1
        return False
    except KeyboardInterrupt:
        counts["operations interrupted"] += 1
        _settle(h, counts)
        return False


def _settle(h, counts):
    """After a Ctrl-C: wait for what the interrupted call left running (an interrupted
    synchronous operation goes on, and wait() waits for it), so its buffer is ours."""
    while True:
        try:
            h.wait()
            return
        except KeyboardInterrupt:
            pass
        except nvmeswap.WorkerDied:
            counts["operations failed by a fault"] += 1
            return


class Interrupter:
    """Sends this process a SIGINT at a random moment inside an armed operation, about
    every ``every`` seconds."""

    def __init__(self, every, rng):
        self.every = every
        self.rng = rng
        self.next_at = time.monotonic() + every

    def armed(self, counts):
        interrupter = self

        class Armed:
            def __enter__(self):
                self.timer = None
                if time.monotonic() >= interrupter.next_at:
                    interrupter.next_at = time.monotonic() + interrupter.every
                    counts["Ctrl-Cs injected"] += 1
                    delay = float(interrupter.rng.uniform(0, 0.005))
                    self.timer = threading.Timer(delay, os.kill,
                                                 args=(os.getpid(), signal.SIGINT))
                    self.timer.start()

            def __exit__(self, *exc_info):
                if self.timer is not None:
                    # A SIGINT sent after the operation ended lands here, inside the
                    # caller's try: the operation counts as interrupted and is redone.
                    self.timer.join()
                    time.sleep(0.01)
                return False
        return Armed()

    def stop(self):
        pass


def _free(path):
    info = os.statvfs(os.path.dirname(path))
    return info.f_bavail * info.f_frsize


def _check_refused(error, path, model, free, offset, data, counts):
    """A write the full disk refused names its file, leaves its length and the disk's
    free space as they were, and every byte old or new (what it overwrote before the
    disk ran out may have landed: the model takes the file's bytes there)."""
    assert error.filename == path, f"ENOSPC names {error.filename}, not {path}"
    with open(path, "rb") as f:
        content = f.read()
    assert len(content) == len(model), f"a refused write changed the length of {path}"
    end = max(offset, min(offset + len(data), len(model)))
    assert content[:offset] == model[:offset] and content[end:] == model[end:], \
        f"a refused write changed {path} outside its range"
    old = np.frombuffer(bytes(model[offset:end]), np.uint8)
    now = np.frombuffer(content[offset:end], np.uint8)
    assert ((now == old) | (now == data[:end - offset])).all(), f"garbage in {path}"
    model[offset:end] = content[offset:end]
    if end == offset:   # all of it past the end: nothing of it may keep a block
        assert _free(path) == free, f"a refused write to {path} kept {free - _free(path)} bytes"
    counts["full-disk refusals"] += 1


def _make_room(paths, models, small):
    """Empty a file of the small filesystem (its model too)."""
    k = len(paths) - small + random.randrange(small)
    os.truncate(paths[k], 0)
    models[k][:] = b""


if __name__ == "__main__":
    main()
