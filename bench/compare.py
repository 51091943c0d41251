"""``nvmeswap bench`` against everything else that can move a tensor to a file, in one run.

    python bench/compare.py --folder /nvme/scratch --size 1G --rounds 3

Contenders, interleaved round by round on one folder: the ``nvmeswap bench`` command
itself (default handle, and ``--ranks 2``), fio (libaio and io_uring; the better one
counts), fio with two jobs (against ``--ranks 2``), DeepSpeed's aio_handle (when
installed), plain Python (buffered write + fsync / readinto, and O_DIRECT os.pwritev /
os.preadv), and torch.save / torch.load. Jobs: overwrite an existing file, and read it
back after dropping the page cache. Printed: GB/s (median over rounds) and the median
per-round ratio of nvmeswap bench to each. ``--peers none`` leaves fio and DeepSpeed out.

    python bench/compare.py --folder /nvme/scratch --size 400M --rounds 3 --ds-io

runs instead DeepSpeed's ``ds_io`` and ``nvmeswap bench`` with the same settings (I/O size,
loops, warm-up loops, block size, queue depth, parallelism, overlapped submission as ds_io
does by default), interleaved, and compares the
``E2E Write/Read Speed`` lines that both print (ds_io's meanings and its GB of 2^30 bytes):
nvmeswap's E2E speed should be within 15 % of ds_io's (a ratio of 0.85 or more). Without
DeepSpeed it says so and exits 0.
"""
import json
import mmap
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
import peers

from nvmeswap.units import parse_size

JOBS = ("write", "read")


class NvmeswapBench:
    """The command line job, as a user runs it; its JSON gives the timed loops' GB/s."""

    def __init__(self, size, ranks=1):
        self.size = size
        self.ranks = ranks

    def run(self, folder):
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            subprocess.run([sys.executable, "-m", "nvmeswap", "bench", "--folder", folder,
                            "--io-size", str(self.size // self.ranks), "--ranks", str(self.ranks),
                            "--loops", "1", "--warmup-loops", "1", "--json", out.name],
                           check=True, capture_output=True)
            jobs = json.load(out)["jobs"]
        return {job: self.size / (jobs[job]["gb_per_s"] * 1e9) for job in JOBS}


class PairedJobs:
    """Adapts a write/read contender (bench/peers.py) to one overwrite + one read."""

    def __init__(self, contender, folder, name):
        self.contender = contender
        self.path = os.path.join(folder, "compare-" + name)

    def run(self, folder):
        peers.fresh(self.contender, self.path)
        self.contender.write(self.path)          # the file exists: the timed write overwrites
        write = self.contender.write(self.path)
        peers.drop_page_cache()
        read = self.contender.read(self.path)
        self.contender.remove(self.path)
        return {"write": write, "read": read}


class BestFio:
    """fio with libaio and with io_uring; the faster of the two for each job."""

    def __init__(self, size, numjobs=1):
        self.engines = [peers.FioContender(size // numjobs, engine, numjobs)
                        for engine in ("libaio", "io_uring")]
        self.folder_name = f"compare-fio{numjobs}"

    def run(self, folder):
        best = {}
        for fio in self.engines:
            seconds = PairedJobs(fio, folder, self.folder_name).run(folder)
            best = {job: min(seconds[job], best.get(job, float("inf"))) for job in JOBS}
        return best


class PlainPython:
    """What a script without any library would do: one big write + fsync, one readinto."""

    def __init__(self, size, direct):
        self.direct = direct
        self.buffer = mmap.mmap(-1, size)       # page-aligned, as O_DIRECT needs
        self.buffer.write(os.urandom(1 << 20) * (size >> 20))

    def write(self, path):
        flags = os.O_WRONLY | os.O_CREAT | (os.O_DIRECT if self.direct else 0)
        fd = os.open(path, flags, 0o644)
        try:
            return peers.timed(self._write_all, fd)
        finally:
            os.close(fd)

    def _write_all(self, fd):
        view = memoryview(self.buffer)
        done = 0
        while done < len(view):
            done += os.pwritev(fd, [view[done:]], done)
        os.fsync(fd)

    def read(self, path):
        fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if self.direct else 0))
        try:
            return peers.timed(os.preadv, fd, [self.buffer], 0)
        finally:
            os.close(fd)

    def remove(self, path):
        if os.path.exists(path):
            os.unlink(path)

    def close(self):
        self.buffer.close()


class TorchSaveLoad:
    def __init__(self, size):
        import torch
        self.tensor = torch.randint(0, 255, (size,), dtype=torch.uint8)

    def write(self, path):
        import torch

        def save():
            with open(path, "wb") as f:
                torch.save(self.tensor, f)
                f.flush()
                os.fsync(f.fileno())
        return peers.timed(save)

    def read(self, path):
        import torch
        return peers.timed(lambda: torch.load(path, weights_only=True))

    def remove(self, path):
        if os.path.exists(path):
            os.unlink(path)

    def close(self):
        pass


# ds_io's summary lines, which nvmeswap bench prints with the same meanings.
E2E_LINE = re.compile(r"^E2E (Read|Write) Speed = ([0-9.e+-]+) GB/sec$", re.MULTILINE)
SAME_SETTINGS = {"loops": "3", "warmup_loops": "1", "block_size": "1M", "queue_depth": "32",
                 "io_parallel": "1"}


def e2e_speeds(output):
    """``{"write": GB/s, "read": GB/s}`` from ds_io-style output (GB = 2^30 bytes)."""
    return {job.lower(): float(value) for job, value in E2E_LINE.findall(output)}


def run_ds_io(folder, size, job):
    """One ds_io run; newer DeepSpeed picks the handle with --engine, older with --handle."""
    common = ["--folder", folder, "--io_size", str(size),
              *[f"--{k}={v}" for k, v in SAME_SETTINGS.items()],
              *(["--read"] if job == "read" else [])]
    for engine in (["--engine", "aio_handle"], ["--handle"]):
        done = subprocess.run(["ds_io", *common, *engine], capture_output=True, text=True,
                              check=False)
        if done.returncode == 0 and job in e2e_speeds(done.stdout):
            return e2e_speeds(done.stdout)[job]
        if "unrecognized arguments" not in done.stderr:
            break
    raise RuntimeError(f"ds_io failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")


def run_nvmeswap(folder, size, job):
    command = [sys.executable, "-m", "nvmeswap", "bench", "--folder", folder,
               "--io-size", str(size), f"--{job}", "--loops", SAME_SETTINGS["loops"],
               "--warmup-loops", SAME_SETTINGS["warmup_loops"],
               "--block-size", SAME_SETTINGS["block_size"],
               "--queue-depth", SAME_SETTINGS["queue_depth"],
               "--intra-op-parallelism", SAME_SETTINGS["io_parallel"],
               "--overlap-events"]       # ds_io overlaps unless told --sequential_requests
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    return e2e_speeds(done.stdout)[job]


def compare_with_ds_io(folder, size, rounds):
    """Interleaved rounds of ds_io and nvmeswap bench; the median ratio of E2E speeds."""
    if shutil.which("ds_io") is None:
        print("DeepSpeed's ds_io is not installed: the E2E comparison is left out "
              "(pip install deepspeed, then run this again)", file=sys.stderr)
        return 0
    ratios = {}
    for job in ("write", "read"):
        pairs = []
        for round_number in range(rounds):
            runs = [("ds_io", run_ds_io), ("nvmeswap", run_nvmeswap)]
            if round_number % 2:
                runs.reverse()
            speeds = {name: run(folder, size, job) for name, run in runs}
            pairs.append(speeds)
            print(f"{job} round {round_number + 1}: ds_io {speeds['ds_io']:.3f}, nvmeswap "
                  f"{speeds['nvmeswap']:.3f} GB/s (E2E, GB = 2^30 bytes)", file=sys.stderr)
        ratios[job] = statistics.median(p["nvmeswap"] / p["ds_io"] for p in pairs)
    print(f"{size / 2**20:.0f} MiB, {rounds} rounds, settings {SAME_SETTINGS}")
    failed = False
    for job, ratio in ratios.items():
        verdict = "within 15 %" if ratio >= 0.85 else "MORE than 15 % slower"
        failed |= ratio < 0.85
        print(f"E2E {job:<5} nvmeswap / ds_io = {ratio:.3f} (median per-round ratio): {verdict}")
    return 1 if failed else 0


def main():
    parser = peers.side_by_side_arguments(__doc__.splitlines()[0])
    parser.add_argument("--ds-io", action="store_true",
                        help="compare E2E speeds with DeepSpeed's ds_io on the same settings")
    peers.add_peers_argument(parser)
    arguments = parser.parse_args()
    folder = arguments.folder
    os.makedirs(folder, exist_ok=True)
    size = parse_size(arguments.size)
    if arguments.ds_io:
        return compare_with_ds_io(folder, size, arguments.rounds)
    contenders = {
        "nvmeswap bench": NvmeswapBench(size),
        "nvmeswap bench --ranks 2": NvmeswapBench(size, ranks=2),
    }
    running = peers.peers_to_run(arguments.peers)
    if "fio" in running:
        contenders["fio (best engine)"] = BestFio(size)
        contenders["fio numjobs=2"] = BestFio(size, numjobs=2)
    if "deepspeed" in running:
        contenders["deepspeed aio_handle"] = PairedJobs(
            peers.DeepSpeedContender(size, "locked"), folder, "deepspeed")
    contenders["python buffered"] = PairedJobs(PlainPython(size, False), folder, "buffered")
    contenders["python O_DIRECT"] = PairedJobs(PlainPython(size, True), folder, "direct")
    contenders["torch.save/load"] = PairedJobs(TorchSaveLoad(size), folder, "torch")

    seconds = {name: {job: [] for job in JOBS} for name in contenders}
    names = list(contenders)
    for round_number in range(arguments.rounds):
        shift = round_number % len(names)
        for name in names[shift:] + names[:shift]:
            for job, value in contenders[name].run(folder).items():
                seconds[name][job].append(value)
        print(f"round {round_number + 1}/{arguments.rounds} done", file=sys.stderr)

    print(f"\n{size / 2**30:.2f} GiB, {arguments.rounds} rounds; GB/s (median) and the median "
          "per-round ratio of nvmeswap bench (--ranks 2 against fio numjobs=2) to each")
    print(f"{'contender':<26}{'write GB/s':>11}{'read GB/s':>11}{'write ratio':>13}"
          f"{'read ratio':>12}")
    for name in names:
        ours = "nvmeswap bench --ranks 2" if name == "fio numjobs=2" else "nvmeswap bench"
        cells = [statistics.median(size / s / 1e9 for s in seconds[name][job]) for job in JOBS]
        ratios = [statistics.median(theirs / mine for mine, theirs
                                    in zip(seconds[ours][job], seconds[name][job]))
                  for job in JOBS]
        print(f"{name:<26}{cells[0]:>11.2f}{cells[1]:>11.2f}{ratios[0]:>12.2f}x"
              f"{ratios[1]:>11.2f}x")
    for contender in contenders.values():
        if isinstance(contender, PairedJobs):
            contender.contender.close()


if __name__ == "__main__":
    sys.exit(main())
