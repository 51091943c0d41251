"""Every bench script, entry points and studies, run once at a tiny size: it exits 0 and
prints the figure lines it exists for. Nothing is asserted about speed (the sizes are far
too small for the figures to mean anything).

The runs are fresh processes, a few at a time, all made before the first test of this
module (so that no process outlives a test); each test then checks one run, so a failure
names its script. DeepSpeed's compiled op (JIT-built for minutes) and fio are left out
with ``--peers none``; a GPU road skips without a GPU. The page cache is kept
(NVMESWAP_BENCH_KEEP_PAGE_CACHE=1): dropping it would make every later process read
torch from disk again.
"""
import concurrent.futures
import dataclasses
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import SLOW_TIER, SLOW_TIER_REASON, may_lock

from nvmeswap._uring import probe

torch = pytest.importorskip("torch", reason="the bench scripts move torch tensors")

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
SHARED_MODULES = {"peers.py"}       # imported by the scripts, never run
RUNS_AT_ONCE = max(2, min(4, os.cpu_count() or 1))
URING_REFUSED = probe() or ""      # why io_uring cannot be used here, if it cannot


@dataclasses.dataclass
class Case:
    script: str                     # under bench/
    arguments: list                 # "{folder}": this run's own empty folder
    expected: list                  # regular expressions, each matching a line of stdout
    skip: str = ""                  # why this case cannot run here
    name: str = ""                  # the test's id, where the script has several cases


CASES = {case.name or case.script: case for case in [
    # The longest first, so that the short ones fill in beside them.
    Case("offload.py",
         ["--folder", "{folder}", "--state-mib", "8", "--steps", "1", "--params", "2e5",
          "--swap-size", "4M", "--ranks", "1"],
         [r"^1\. Adam step", r"^   overlapped / synchronous: \d+\.\d\d$",
          r"^   1 rank\(s\): write \d+\.\d\d \(\d+\.\d\dx of", r"^   with offload: +\d+ MiB$",
          r"^   in memory \d+\.\d+ s, offloaded \d+\.\d+ s: \d+\.\d\dx$",
          r"^   the step moves what the device moves at bench speed in \d+\.\d\d of its time"]),
    Case("peers_table.py",
         ["--folder", "{folder}", "--sizes", "1M", "--rounds", "1", "--small-ops", "256",
          "--small-seconds", "0.1", "--small-file-size", "4M", "--peers", "none"],
         [r"^measurement +nvmeswap +peer +ratio +rounds +goal +met$",
          (r"^1M fresh write: nvmeswap plain / nvmeswap locked +\d+\.\d\d GB/s +\d+\.\d\d GB/s"
           r" +\d+\.\d\dx "),
          r"^1M first read: nvmeswap locked / deepspeed locked .* missing",
          r"^1M: nvmeswap plain staging held +\d+ MiB",
          r"^4 KiB async random reads: nvmeswap / deepspeed +\d+/s",
          r"^sync 64 KiB random reads: nvmeswap / deepspeed +\d+/s"]),
    Case("studies/tune_quality.py",
         ["--folder", "{folder}", "--rounds", "1", "--io-size", "1M", "--budget-seconds", "1",
          "--exhaustive-seconds", "2"],
         [r"^nvmeswap tune --exhaustive: +\d+\.\d s, \d+ configurations, pick \{",
          r"^quick / exhaustive: \d+\.\d{3} \(median per-round ratio\)$"]),
    Case("studies/staging_first_use.py",
         ["--folder", "{folder}", "--size", "2M", "--rounds", "1"],
         [r"^contender +fresh write +overwrite +cold read$",
          r"^plain, staging used( +\d+\.\d\d GB/s \d+\.\d\dx){3}$"]),
    Case("compare.py", ["--folder", "{folder}", "--size", "2M", "--rounds", "1", "--peers", "none"],
         [r"^contender +write GB/s +read GB/s +write ratio +read ratio$",
          r"^nvmeswap bench --ranks 2 +\d+\.\d\d +\d+\.\d\d +\d+\.\d\dx +\d+\.\d\dx$",
          r"^torch\.save/load +\d+\.\d\d +\d+\.\d\d +\d+\.\d\dx +\d+\.\d\dx$"]),
    Case("compare.py", ["--folder", "{folder}", "--size", "2M", "--rounds", "1", "--ds-io"],
         [r"^E2E write nvmeswap / ds_io = \d+\.\d{3}"],
         skip="needs DeepSpeed's compiled op (ds_io JIT-builds it, minutes)",
         name="compare.py --ds-io"),
    Case("checkpoint.py", ["--folder", "{folder}", "--size", "4M", "--rounds", "1"],
         [r"^state: .* every load byte-identical: True$",
          r"^nvmeswap\.save +\d+\.\d+ +\d+\.\d\d$",
          r"^  nvmeswap\.save vs torch\.save +\d+\.\d\dx$",
          r"^async_save: caller blocked \d+\.\d+ s .* byte-identical: True$",
          (r"^background snapshot: caller blocked \d+\.\d+ s, a \d+\.\d+ s computation "
           r"beside the copy slowed -?\d+\.\d+ s; blocked / synchronous = \d+\.\d\d"),
          r"^one-call nvmeswap\.async_save: caller blocked \d+\.\d+ s"]),
    Case("checkpoint.py", ["--folder", "{folder}", "--size", "4M", "--rounds", "1",
                           "--layers", "100", "--only", "torch.save,nvmeswap.save"],
         [r"^state: .*200 tensors.* every load byte-identical: True$",
          r"^  nvmeswap\.save vs torch\.save +\d+\.\d\dx$"],
         name="checkpoint.py --layers"),
    Case("checkpoint.py", ["--folder", "{folder}", "--size", "4M", "--rounds", "1",
                           "--stripe", "{folder}/s0,{folder}/s1",
                           "--only", "nvmeswap.save,nvmeswap.load"],
         [r"^state: .* every load byte-identical: True$",
          r"^nvmeswap\.save striped \(kept\) +\d+\.\d+ +\d+\.\d\d$",
          r"^  kept striped load vs kept load +\d+\.\d\dx$"],
         name="checkpoint.py --stripe"),
    Case("checkpoint.py", ["--folder", "{folder}", "--size", "4M", "--rounds", "1",
                           "--device", "cuda"],
         [r"^state: .* on cuda, .* every load byte-identical: True$",
          r"^  nvmeswap\.save vs torch\.save +\d+\.\d\dx$",
          r"^one-call nvmeswap\.async_save: caller blocked \d+\.\d+ s"],
         skip="" if torch.cuda.is_available() else "needs a CUDA GPU; torch sees none",
         name="checkpoint.py --device cuda"),
    Case("cpu_per_byte.py",
         ["--folder", "{folder}", "--size", "4M", "--rounds", "1", "--peers", "none"],
         [r"^CPU seconds per GB, 4M locked", r"^cold read +[0-9.]+$"]),
    Case("small_async.py",
         ["--folder", "{folder}", "--ops", "256", "--rounds", "1", "--file-size", "4M",
          "--peers", "none"],
         [r"^4 KiB random async reads, wait\(\) every 256, 256 reads",
          r"^  nvmeswap +\d+$", r"^  queue alone +\d+$"]),
    Case("soak.py", ["--folder", "{folder}", "--minutes", "0.05", "--kill-every", "1"],
         [r"^done: \{'operations': [1-9]", r"leaks: 0$"]),
    Case("gpu_roads.py",
         ["--folder", "{folder}", "--size", "2M", "--rounds", "1", "--peers", "none"],
         [r"^contender +fresh write +overwrite +read$",
          r"^nvmeswap aio cuda +vs nvmeswap aio host locked +fresh write: +\d+\.\d\dx"],
         skip="" if torch.cuda.is_available() else "needs a CUDA GPU; torch sees none"),
    Case("gpu_copies.py", ["--size", "4M", "--copies", "2"],
         [r"^contender +H2D GB/s +D2H GB/s +is_pinned$",
          r"^nvmeswap locked +\d+\.\d +\d+\.\d +True$",
          r"^nvmeswap locked / torch pin_memory: H2D \d+\.\d\dx, D2H \d+\.\d\dx$"],
         skip="" if torch.cuda.is_available() else "needs a CUDA GPU; torch sees none"),
    Case("studies/ring_overhead.py", ["--folder", "{folder}", "--size", "2M", "--rounds", "1"],
         [r"^contender +fresh write +overwrite +read$",
          r"^ring +vs locked +fresh write: +\d+\.\d\dx +overwrite: +\d+\.\d\dx +read: +\d+\.\d\dx"]),
    Case("studies/first_touch.py", ["--samples", "1", "--pause", "0"],
         [(r"64 MiB: first fill +\d+\.\d ms, second +\d+\.\d ms, first fill of pages made "
           r"elsewhere +\d+\.\d ms$")]),
    Case("studies/locked_allocation.py", ["--size", "64M", "--rounds", "1"],
         [r"^mlock\(2\) +\d+\.\d{3} s a GiB \(1\.00x mlock\(2\)\)$",
          r"^Mapping\.lock, 1 CPU +\d+\.\d{3} s a GiB \(\d+\.\d\dx mlock\(2\)\)$",
          r"^Mapping\.lock, every CPU \(\d+\) +\d+\.\d{3} s a GiB"],
         skip="" if may_lock(64 << 20) else "needs RLIMIT_MEMLOCK >= 64 MiB"),
    Case("studies/load_floor.py", ["--folder", "{folder}", "--size", "4M", "--rounds", "1"],
         [r"^torch\.load +\d+\.\d{3}$", r"^O_DIRECT stream +\d+\.\d{3}$",
          r"^3x torch\.load would take \d+\.\d{3} s; the stream alone is \d+\.\d\dx"]),
    Case("studies/model_state.py", ["--folder", "{folder}", "--rounds", "1"],
         [r"^model state: 758 tensors, 174 MiB; .* the same values: True$",
          r"^nvmeswap\.save vs torch\.save \+ fsync: \d+\.\d\dx$",
          r"^nvmeswap\.load vs torch\.load: \d+\.\d\dx$",
          r"^nvmeswap\.async_save, background snapshot blocked / nvmeswap\.save: \d+\.\d\d$"]),
    Case("studies/layout_cost.py", ["--rounds", "1", "--tensors", "20"],
         [r"^20 small tensors: layout \d+\.\d / \d+\.\d; .* layout / torch\.save \d+\.\d\d$",
          r"^model state: layout \d+\.\d / \d+\.\d; .* layout / torch\.save \d+\.\d\d$"]),
    Case("studies/control_path.py", ["--folder", "{folder}", "--count", "100"],
         [r"^sync_pread, whole call in this thread: +\d+\.\d us$",
          r"control path round trip +-?\d+\.\d us$", r"control path per chunk +-?\d+\.\d us$"]),
    Case("studies/preallocation.py",
         ["--folder", "{folder}", "--size", "1048576", "--rounds", "1"],
         [r"^fresh, preallocated +\d+\.\d\d GB/s$", r"^fresh, not preallocated +\d+\.\d\d GB/s$",
          r"^overwrite +\d+\.\d\d GB/s$"]),
    Case("studies/small_async_costs.py",
         ["--file", "{folder}/small-async.bin", "--file-size", "4M", "--ops", "256"],
         [r"^[\d,]+ reads/s, \d+\.\d us a read: starting \d+\.\d, waiting \d+\.\d",
          r"^  Scheduler\.submit \(all of starting\) +\d+\.\d us a read$"]),
    Case("studies/shared_memory_cost.py",
         ["--folder", "{folder}", "--size", "1048576", "--rounds", "1"],
         [r"^write .* shared/private: \d+\.\d\d$", r"^read .* shared/private: \d+\.\d\d$"]),
    Case("engines.py", ["--folder", "{folder}", "--size", "2M", "--rounds", "1", "--ops", "256"],
         [r"^measurement +aio +uring +uring / aio$",
          r"^fresh write +\d+\.\d\d GB/s +\d+\.\d\d GB/s +\d+\.\d\dx",
          r"^4 KiB async reads +\d+/s +\d+/s +\d+\.\d\dx"], skip=URING_REFUSED),
    # 32K: io_uring charges registered buffers to RLIMIT_MEMLOCK (64 KiB by default).
    Case("studies/fixed_buffers.py", ["--folder", "{folder}", "--size", "32K", "--rounds", "1"],
         [r"^uring, registered( +\d+\.\d\d){3}$",
          r"^uring, registered / uring: +fresh write \d+\.\d\dx"], skip=URING_REFUSED),
    Case("studies/queue_post.py",
         ["--file", "{folder}/queue-post.bin", "--file-size", "4M", "--ops", "256",
          "--rounds", "1"],
         [r"^aio post +\d+/s +1\.00x$", r"^uring post_many +\d+/s +\d+\.\d\dx$"],
         skip=URING_REFUSED),
    Case("studies/deepspeed_unaligned_slices.py",
         ["--engine", "nvmeswap", "--folder", "{folder}"],
         [r"^nvmeswap +slice 0: ", r"^nvmeswap: 8 of 8 slices bit-exact$"]),
]}


@dataclasses.dataclass
class Run:
    command: list
    returncode: int
    stdout: str
    stderr: str
    seconds: float


def run_case(case, folder):
    folder.mkdir()
    command = [sys.executable, str(BENCH / case.script),
               *(a.replace("{folder}", str(folder)) for a in case.arguments)]
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "NVMESWAP_BENCH_KEEP_PAGE_CACHE": "1"}
    started = time.monotonic()
    done = subprocess.run(command, cwd=folder, env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=300, check=False)
    return Run(command, done.returncode, done.stdout, done.stderr, time.monotonic() - started)


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """Every selected case that can run here, run to its end before the first test."""
    wanted = {item.callspec.params["name"] for item in request.session.items
              if item.module is request.module and hasattr(item, "callspec")
              and "name" in item.callspec.params}
    base = tmp_path_factory.mktemp("bench-smoke")
    with concurrent.futures.ThreadPoolExecutor(RUNS_AT_ONCE) as pool:
        futures = {name: pool.submit(run_case, case, base / f"case{index}")
                   for index, (name, case) in enumerate(CASES.items())
                   if name in wanted and not case.skip}
        return {name: future.result() for name, future in futures.items()}


# The slow tier (conftest.SLOW_TIER): about a minute of two cores; elsewhere one skip.
@pytest.mark.parametrize("name", list(CASES) if SLOW_TIER else [pytest.param(
    "every script", marks=pytest.mark.skip(reason=SLOW_TIER_REASON))])
def test_bench_script_runs_and_prints_its_figures(name, runs):
    case = CASES[name]
    if case.skip:
        pytest.skip(case.skip)
    run = runs[name]
    shown = (f"{' '.join(run.command)}\nexit status {run.returncode} after {run.seconds:.1f} s"
             f"\n--- stdout\n{run.stdout[-4000:]}\n--- stderr\n{run.stderr[-4000:]}")
    assert run.returncode == 0, shown
    missing = [p for p in case.expected if not re.search(p, run.stdout, re.MULTILINE)]
    assert not missing, f"no line matches {missing}\n{shown}"


def test_every_bench_script_has_a_smoke_case():
    """A script is a file under bench/ with a ``__main__`` block; anything else there is a
    module the scripts share, named in SHARED_MODULES."""
    files = {str(p.relative_to(BENCH)) for p in BENCH.rglob("*.py")}
    scripts = {f for f in files if '__name__ == "__main__"' in (BENCH / f).read_text()}
    with_cases = {case.script for case in CASES.values()}
    assert scripts - with_cases == set(), "bench scripts without a smoke case"
    assert with_cases - files == set(), "smoke cases of scripts that are gone"
    assert files - scripts == SHARED_MODULES, "bench files that are neither scripts nor shared"
