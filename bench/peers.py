"""The contenders of the side-by-side benchmarks: nvmeswap, fio and DeepSpeed, one call each.

Every function moves ``size`` bytes once and returns the seconds it took. Peers that
are not installed are reported as missing, never as zero. Also what several scripts
share: their arguments, the interleaved rounds of write / overwrite / read, and the
count of small synchronous reads.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time

# torch and nvmeswap are imported where a contender is made: a script's lightest
# processes (small_async.py's "queue alone") load neither.

PEERS = ("deepspeed", "fio")
JOBS = ("fresh write", "overwrite", "read")


def side_by_side_arguments(description):
    """The arguments of every side-by-side script: --folder, --size, --rounds."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--folder", default="nvmeswap-bench-data")
    parser.add_argument("--size", default="1G")
    parser.add_argument("--rounds", type=int, default=3)
    return parser


def add_peers_argument(parser, peers=PEERS):
    """``--peers``: which peers run beside nvmeswap (default: every one installed)."""
    parser.add_argument("--peers", type=lambda text: peer_list(parser, text, peers),
                        default=peers, metavar="LIST",
                        help=f"comma-separated, of {','.join(peers)}; 'none' runs nvmeswap "
                             f"alone (default: every peer that is installed)")


def peer_list(parser, text, peers):
    chosen = () if text == "none" else tuple(p for p in text.split(",") if p)
    unknown = set(chosen) - set(peers)
    if unknown:
        parser.error(f"--peers takes {','.join(peers)} or none, not {','.join(sorted(unknown))}")
    return chosen


def peers_to_run(asked):
    """The peers of ``asked`` that are installed; says on stderr which are left out."""
    installed = {"deepspeed": deepspeed_available, "fio": fio_available}
    running = set()
    for peer in asked:
        if installed[peer]():
            running.add(peer)
        else:
            print(f"{peer} is not installed: its figures are left out", file=sys.stderr)
    return running


def run_rounds(folder, size, rounds, everyone):
    """``{(name, job): [seconds per round]}``: every contender's fresh write, overwrite and
    read (page cache dropped), in turn, rotated each round."""
    seconds = {(name, job): [] for name in everyone for job in JOBS}
    names = list(everyone)
    for round_number in range(rounds):
        # Rotate who goes first, so that no contender always follows the same neighbour.
        shift = round_number % len(names)
        for name in names[shift:] + names[:shift]:
            contender = everyone[name]
            path = os.path.join(folder, "bench-" + name.replace(" ", "-"))
            fresh(contender, path)
            seconds[name, "fresh write"].append(contender.write(path))
            os.sync()
            seconds[name, "overwrite"].append(contender.write(path))
            drop_page_cache()
            seconds[name, "read"].append(contender.read(path))
        print(f"round {round_number + 1}/{rounds} done", file=sys.stderr)
    for name, contender in everyone.items():
        contender.remove(os.path.join(folder, "bench-" + name.replace(" ", "-")))
    return seconds


def small_reads(folder, everyone_small, op_size, duration):
    """Synchronous reads of ``op_size`` bytes at random aligned offsets, per second."""
    import torch

    path = os.path.join(folder, "bench-small")
    with open(path, "wb") as f:
        f.write(os.urandom(64 << 20))
    os.sync()
    slots = (64 << 20) // op_size
    rates = {}
    for name, (handle, buffer) in everyone_small.items():
        offsets = torch.randint(0, slots, (100_000,)).tolist()
        count, started = 0, time.perf_counter()
        while time.perf_counter() - started < duration:
            handle.sync_pread(buffer, path, offsets[count % len(offsets)] * op_size)
            count += 1
        rates[name] = count / (time.perf_counter() - started)
    os.unlink(path)
    return rates


def drop_page_cache():
    """Best effort: reads after this come from the device (needs root); whether they do.

    NVMESWAP_BENCH_KEEP_PAGE_CACHE=1 keeps it (the smoke test's tiny runs: dropping
    the whole machine's page cache makes every process on it, the next runs included,
    read its libraries from disk again).
    """
    os.sync()
    if os.environ.get("NVMESWAP_BENCH_KEEP_PAGE_CACHE") == "1":
        return False
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def child_result(command, what):
    """Run ``command`` (a script's own child process) and return the JSON of the last
    line it prints; a failure raises, naming ``what``, with the child's stderr."""
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{what} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def rotated(names, turn):
    """``names`` starting at the ``turn``-th (each round another goes first)."""
    turn = turn % len(names) if names else 0
    return names[turn:] + names[:turn]


def fresh(contender, path):
    contender.remove(path)
    os.sync()


def timed(function, *args):
    started = time.perf_counter()
    function(*args)
    return time.perf_counter() - started


class HandleContender:
    """An aio_handle (nvmeswap's or DeepSpeed's) moving one tensor, locked or plain."""

    def __init__(self, handle, size, buffer):
        import torch

        self.handle = handle
        if buffer == "locked":
            self.tensor = handle.new_cpu_locked_tensor(size, torch.empty(0, dtype=torch.uint8))
        else:
            self.tensor = torch.empty(size, dtype=torch.uint8)
        self.tensor.random_(0, 255)

    def write(self, path):
        return timed(self.handle.sync_pwrite, self.tensor, path)

    def read(self, path):
        return timed(self.handle.sync_pread, self.tensor, path)

    def remove(self, path):
        if os.path.exists(path):
            os.unlink(path)

    def close(self):
        if self.handle.is_pinned(self.tensor):
            self.handle.free_cpu_locked_tensor(self.tensor)


class NvmeswapContender(HandleContender):
    def __init__(self, size, buffer, **handle_args):
        import nvmeswap

        super().__init__(nvmeswap.aio_handle(**handle_args), size, buffer)

    def close(self):
        super().close()
        self.handle.close()


class DeepSpeedContender(HandleContender):
    """DeepSpeed's aio_handle; its plain-tensor path allocates a locked bounce buffer per call."""

    def __init__(self, size, buffer, **handle_args):
        from deepspeed.ops.op_builder import AsyncIOBuilder
        super().__init__(AsyncIOBuilder().load(verbose=False).aio_handle(**handle_args), size,
                         buffer)


def deepspeed_available():
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder
        return AsyncIOBuilder().is_compatible(verbose=False)
    except Exception:
        return False


class FioContender:
    """fio with O_DIRECT, by default 1 MiB blocks, iodepth 128: the device's own limit.

    With ``numjobs`` > 1 each job has its own file of ``size`` bytes, like nvmeswap's ranks.
    """

    def __init__(self, size, engine="libaio", numjobs=1, bs=1 << 20, iodepth=128):
        self.size = size
        self.engine = engine
        self.numjobs = numjobs
        self.bs = bs
        self.iodepth = iodepth

    def _run(self, path, rw):
        command = ["fio", "--name=nvmeswap-peer", f"--directory={os.path.dirname(path) or '.'}",
                   f"--filename_format={os.path.basename(path)}.$jobnum", f"--rw={rw}",
                   f"--bs={self.bs}", f"--iodepth={self.iodepth}", "--direct=1",
                   f"--ioengine={self.engine}",
                   f"--size={self.size}", f"--numjobs={self.numjobs}", "--group_reporting",
                   "--output-format=json", "--thread", "--fallocate=none"]
        output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        job = json.loads(output[output.index("{"):])["jobs"][0]
        side = job["read" if rw == "read" else "write"]
        return side["io_bytes"] / max(side["bw_bytes"], 1)

    def write(self, path):
        return self._run(path, "write")

    def read(self, path):
        return self._run(path, "read")

    def remove(self, path):
        for job in range(self.numjobs):
            if os.path.exists(f"{path}.{job}"):
                os.unlink(f"{path}.{job}")

    def close(self):
        pass


def fio_available():
    return shutil.which("fio") is not None


class CudaTensorContender(HandleContender):
    """A handle moving one CUDA tensor: aio_handle stages it, gds_handle uses cuFile."""

    def __init__(self, handle, size, pin=False):
        import torch

        self.handle = handle
        self.tensor = torch.randint(0, 255, (size,), dtype=torch.uint8, device="cuda")
        self.pinned = pin and bool(handle.pin_device_tensor(self.tensor))

    def write(self, path):
        import torch

        torch.cuda.synchronize()
        return timed(self.handle.sync_pwrite, self.tensor, path)

    def close(self):
        if self.pinned:
            self.handle.unpin_device_tensor(self.tensor)
        if hasattr(self.handle, "close"):
            self.handle.close()


def deepspeed_gds_available():
    try:
        from deepspeed.ops.op_builder import GDSBuilder
        return GDSBuilder().is_compatible(verbose=False)
    except Exception:
        return False
