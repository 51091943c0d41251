"""``nvmeswap bench`` as users of ds_io expect it: ds_io's meanings and units, a progress bar
only on a terminal, Ctrl-C that keeps the loops measured, and refusals up front."""
import fcntl
import json
import os
import pty
import re
import select
import shutil
import signal
import struct
import subprocess
import sys
import termios
import time

import pytest
from conftest import needs_torch, torch_sees_a_gpu, without_file_privileges

DS_IO_LINE = re.compile(r"^(Task|E2E) (Read|Write) (Latency|Speed) = ([0-9.e+-]+) (sec|GB/sec)$",
                        re.MULTILINE)


def run_cli(*args, cwd=None, prefix=(), code=None):
    """The command as a user runs it; ``code`` runs instead of ``-m nvmeswap`` (for a patch)."""
    program = ["-c", code, *map(str, args)] if code else ["-m", "nvmeswap", *map(str, args)]
    return subprocess.run([*prefix, sys.executable, *program], capture_output=True, text=True,
                          timeout=240, cwd=cwd, check=False)


def ds_io_lines(stdout):
    return {(kind, job.lower(), what): float(value)
            for kind, job, what, value, _ in DS_IO_LINE.findall(stdout)}


def test_ds_io_lines_have_ds_io_meanings(tmp_path):
    """Task = the timed operations summed, E2E = operations and barriers summed (no set-up,
    no warm-up), both over all ranks' bytes in ds_io's GB of 2^30: the same run's JSON holds
    every loop's times, so the printed lines are recomputed from them exactly."""
    out = tmp_path / "b.json"
    result = run_cli("bench", "--folder", tmp_path, "--io-size", "2M", "--loops", 3,
                     "--warmup-loops", 2, "--ranks", 2, "--folder", tmp_path, "--buffer",
                     "numpy", "--json", out)
    assert result.returncode == 0, result.stderr
    lines = ds_io_lines(result.stdout)
    summary = json.loads(out.read_text())
    for job in ("write", "read"):
        per_rank = [rank["jobs"][job] for rank in summary["ranks"]]
        assert [len(r["task_seconds"]) for r in per_rank] == [3, 3]    # warm-up not timed
        task = max(sum(r["task_seconds"]) for r in per_rank)
        e2e = max(sum(r["e2e_seconds"]) for r in per_rank)
        moved = 2 * 3 * (2 << 20)
        assert lines[("Task", job, "Latency")] == task
        assert lines[("E2E", job, "Latency")] == e2e
        assert lines[("Task", job, "Speed")] == moved / task / 2**30
        assert lines[("E2E", job, "Speed")] == moved / e2e / 2**30
        # E2E is Task plus the barrier of each loop: never less, loop by loop.
        for rank in per_rank:
            for task_s, e2e_s in zip(rank["task_seconds"], rank["e2e_seconds"]):
                assert 0 < task_s <= e2e_s
        figures = summary["jobs"][job]
        assert figures["gb_per_s"] == moved / task / 1e9       # the table's GB is 10^9
        assert figures["e2e_latency_s"] == e2e and figures["bytes"] == moved
    assert "GB = 10^9 bytes" in result.stdout and "GB = 2^30 bytes" in result.stdout


SET_UP_TAKES_HOURS = """
import sys, time
import nvmeswap.aio, nvmeswap.cli.bench_ranks as ranks
from nvmeswap.cli.main import main
HOUR, moved, calls = 3600.0, [0.0], [0]

class Clock:                 # the bench's clock, which set-up and warm-up move on
    def __getattr__(self, name):
        return getattr(time, name)

    def perf_counter(self):
        return time.perf_counter() + moved[0]

def an_hour_more(function):
    def slow(*args, **kwargs):
        moved[0] += HOUR
        return function(*args, **kwargs)
    return slow

ranks.time = Clock()
ranks._make_buffer, ranks.fill = an_hour_more(ranks._make_buffer), an_hour_more(ranks.fill)
timed = nvmeswap.aio.aio_handle.pwrite

def pwrite(self, *args, **kwargs):
    calls[0] += 1
    return (an_hour_more(timed) if calls[0] == 1 else timed)(self, *args, **kwargs)  # warm-up

nvmeswap.aio.aio_handle.pwrite = pwrite
status = main(sys.argv[1:])
print(f"set-up and warm-up moved the clock {moved[0]:.0f} s", file=sys.stderr)
sys.exit(status)
"""


def test_e2e_speed_is_not_diluted_by_set_up(tmp_path):
    """One rank: E2E and Task time the same loops and nothing else. Here making the
    buffer, filling it and the warm-up loop each move the bench's clock on by an hour:
    a figure that timed any of them would hold an hour; E2E holds only the loops."""
    out = tmp_path / "b.json"
    result = run_cli("bench", "--folder", tmp_path, "--io-size", "4M", "--loops", 2,
                     "--warmup-loops", 1, "--write", "--buffer", "numpy", "--json", out,
                     code=SET_UP_TAKES_HOURS)
    assert result.returncode == 0, result.stderr
    assert "set-up and warm-up moved the clock 10800 s" in result.stderr
    rank = json.loads(out.read_text())["ranks"][0]["jobs"]["write"]
    lines = ds_io_lines(result.stdout)
    assert lines[("E2E", "write", "Latency")] == sum(rank["e2e_seconds"])
    assert lines[("Task", "write", "Latency")] == sum(rank["task_seconds"])
    assert len(rank["e2e_seconds"]) == 2
    assert 0 < lines[("Task", "write", "Latency")] <= lines[("E2E", "write", "Latency")] < 3600
    assert {k[1] for k in lines} == {"write"}


def test_progress_bar_on_a_terminal_quiet_when_piped(tmp_path):
    piped = run_cli("bench", "--folder", tmp_path, "--io-size", "1M", "--loops", 2, "--write",
                    "--buffer", "numpy")
    assert piped.returncode == 0 and piped.stderr == ""
    primary, secondary = pty.openpty()
    # A terminal 100 columns wide (a new one has none, and tqdm draws nothing in 0 columns).
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    process = subprocess.Popen([sys.executable, "-m", "nvmeswap", "bench", "--folder",
                                str(tmp_path), "--io-size", "1M", "--loops", "2", "--write",
                                "--buffer", "numpy"],
                               stdout=subprocess.PIPE, stderr=secondary)
    # The terminal stays open here until the command ends: Linux drops what is left unread
    # in a terminal once its last holder closes it.
    seen = b""
    while True:
        ready, _, _ = select.select([primary], [], [], 0.1)
        if ready:
            seen += os.read(primary, 65536)
        elif process.poll() is not None:
            break
    os.close(secondary)
    os.close(primary)
    stdout = process.stdout.read().decode()
    process.stdout.close()
    assert process.wait() == 0
    assert "write 1M" in seen.decode() and "loop" in seen.decode()     # tqdm's bar
    assert "Task Write Speed" in stdout and "write 1M:" not in stdout


def test_ctrl_c_stops_cleanly_and_keeps_the_loops(tmp_path):
    """Ctrl-C once the progress bar (on a terminal) shows two timed loops done: the loops
    measured are kept and printed, the file is removed, the exit status is 130."""
    folder = tmp_path / "data"
    folder.mkdir()
    out = tmp_path / "b.json"
    primary, secondary = pty.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    process = subprocess.Popen([sys.executable, "-m", "nvmeswap", "bench", "--folder",
                                str(folder), "--io-size", "1M", "--loops", "10000000",
                                "--write", "--buffer", "numpy", "--json", str(out)],
                               stdout=subprocess.PIPE, stderr=secondary, text=True,
                               start_new_session=True)
    seen = b""

    def read_terminal():
        nonlocal seen
        ready, _, _ = select.select([primary], [], [], 0.1)
        if ready:
            seen += os.read(primary, 65536)

    deadline = time.monotonic() + 120       # for a hang only
    while not re.search(rb"write 1M.*?\b([2-9]|\d\d+)/10000000", seen):
        assert process.poll() is None and time.monotonic() < deadline, seen
        read_terminal()
    os.killpg(process.pid, signal.SIGINT)    # as a terminal's Ctrl-C: the whole group
    while process.poll() is None:
        read_terminal()
    read_terminal()
    os.close(secondary)
    os.close(primary)
    stdout = process.stdout.read()
    process.stdout.close()
    stderr = seen.decode(errors="replace")
    assert process.returncode == 130, stderr
    assert "Traceback" not in stderr and "interrupted" in stderr
    assert os.listdir(folder) == []          # its file is removed
    summary = json.loads(out.read_text())
    assert summary["interrupted"] is True
    loops = summary["jobs"]["write"]["loops"]
    assert 2 <= loops < 10000000
    assert len(summary["ranks"][0]["jobs"]["write"]["task_seconds"]) == loops
    assert ds_io_lines(stdout)[("Task", "write", "Latency")] == \
        sum(summary["ranks"][0]["jobs"]["write"]["task_seconds"])


def test_refuses_unused_and_contradictory_options(tmp_path):
    second = tmp_path / "second"
    second.mkdir()
    unused = run_cli("bench", "--folder", tmp_path, "--folder", second, "--io-size", "1M")
    assert unused.returncode == 2 and "never be used" in unused.stderr
    assert str(second) in unused.stderr and "--ranks 2" in unused.stderr
    both = run_cli("bench", "--folder", tmp_path, "--overlap-events", "--sequential-requests")
    assert both.returncode == 2 and "not allowed with argument" in both.stderr
    if not torch_sees_a_gpu():
        pinned = run_cli("bench", "--folder", tmp_path, "--io-size", "1M", "--buffer", "pinned")
        assert pinned.returncode == 2
        assert pinned.stderr.strip().splitlines() == [
            ("nvmeswap bench: --buffer pinned needs a CUDA GPU (CUDA-pinned host memory), and "
             "there is none here; use --buffer locked")]
    assert os.listdir(tmp_path) == ["second"]


@pytest.mark.parametrize("args, message", [
    (("--loops", "0"), "must be 1 or more, got 0"),
    (("--warmup-loops", "-1"), "must be 0 or more, got -1"),
    (("--queue-depth", "many"), "not a whole number: 'many'"),
    (("--io-size", "0"), "must be more than 0 bytes"),
    (("--block-size", "1X"), "not a size: '1X'"),
])
def test_validation_speaks_in_option_names(tmp_path, args, message):
    """argparse names the option as typed (with ds_io's underscore spelling beside it)."""
    result = run_cli("bench", "--folder", tmp_path, *args)
    last = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 2
    assert last.startswith(f"nvmeswap bench: error: argument {args[0]}") and message in last
    assert "Traceback" not in result.stderr


def test_output_path_checked_before_the_run(tmp_path):
    missing = run_cli("bench", "--folder", tmp_path, "--io-size", "1M",
                      "--json", tmp_path / "no" / "b.json")
    assert missing.returncode == 2 and missing.stdout == ""            # nothing was run
    assert missing.stderr.strip().splitlines() == [
        (f"nvmeswap bench: --json {tmp_path}/no/b.json: folder {tmp_path}/no does not exist; "
         f"create it (mkdir -p {tmp_path}/no) or pick another path")]
    folder = run_cli("bench", "--folder", tmp_path, "--io-size", "1M", "--json", tmp_path)
    assert folder.returncode == 2 and "is a folder" in folder.stderr
    assert os.listdir(tmp_path) == []


def test_json_to_stdout_keeps_the_table_on_stderr(tmp_path):
    result = run_cli("bench", "--folder", tmp_path, "--io-size", "1M", "--loops", 1,
                     "--read", "--buffer", "numpy", "--json", "-")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert list(summary["jobs"]) == ["read"] and "Task Read Speed" in result.stderr


def test_not_enough_memory_is_refused_up_front(tmp_path):
    """The check reads MemAvailable and the cgroup's limit; here it is told 1 MiB is left."""
    code = ("import sys; import nvmeswap.cli.bench as bench; "
            "bench.available_memory = lambda: 1 << 20; "
            "from nvmeswap.cli.main import main; sys.exit(main(sys.argv[1:]))")
    result = run_cli("bench", "--folder", tmp_path, "--io-size", "3M", "--ranks", 2,
                     "--folder", tmp_path, code=code)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        ("nvmeswap bench: the run needs 6.0 MiB of memory (--ranks x --io-size) and 1.0 MiB is "
         "available: lower --io-size or --ranks")]
    assert os.listdir(tmp_path) == []


def test_available_memory_is_real():
    import psutil

    from nvmeswap.cli.bench import available_memory
    assert 0 < available_memory() <= psutil.virtual_memory().total


def test_default_folder_in_an_unwritable_directory(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    result = run_cli("bench", "--io-size", "1M", cwd=locked, prefix=without_file_privileges())
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "not writable" in result.stderr and "--folder" in result.stderr


@needs_torch
def test_table_does_not_say_locked_when_locking_is_refused(tmp_path):
    """Without CAP_IPC_LOCK and with a 64 KiB RLIMIT_MEMLOCK, a 1 MiB locked tensor stays
    unlocked: the table says so, and the JSON too."""
    if shutil.which("setpriv") is None or shutil.which("prlimit") is None:
        pytest.skip("setpriv and prlimit are needed to drop CAP_IPC_LOCK")
    prefix = ("setpriv", "--bounding-set", "-ipc_lock", "--inh-caps", "-ipc_lock",
              "prlimit", "--memlock=65536:65536")
    out = tmp_path / "b.json"
    result = run_cli("bench", "--folder", tmp_path, "--io-size", "1M", "--loops", 1,
                     "--write", "--json", out, prefix=prefix)
    assert result.returncode == 0, result.stderr
    header = result.stdout.splitlines()[0]
    assert "buffer shared, NOT page-locked" in header and "buffer locked" not in header
    assert json.loads(out.read_text())["page_locked"] is False
    normal = run_cli("bench", "--folder", tmp_path, "--io-size", "1M", "--loops", 1,
                     "--write", "--json", out)
    assert normal.returncode == 0
    if json.loads(out.read_text())["page_locked"]:
        assert normal.stdout.splitlines()[0].endswith("buffer locked")


def test_closed_pipe_keeps_the_json(tmp_path):
    """`nvmeswap bench --json F | head -0`: the reader is gone before the table; the JSON
    was written first, and the command ends quietly."""
    out = tmp_path / "b.json"
    read_end, write_end = os.pipe()
    os.close(read_end)                       # nobody will ever read the table
    process = subprocess.Popen([sys.executable, "-m", "nvmeswap", "bench", "--folder",
                                str(tmp_path), "--io-size", "1M", "--loops", "2",
                                "--buffer", "numpy", "--json", str(out)],
                               stdout=write_end, stderr=subprocess.PIPE, text=True)
    os.close(write_end)
    stderr = process.communicate(timeout=120)[1]
    assert process.returncode == 1 and stderr == ""
    summary = json.loads(out.read_text())
    assert [summary["jobs"][job]["loops"] for job in ("write", "read")] == [2, 2]
    assert sorted(os.listdir(tmp_path)) == ["b.json"]


@pytest.mark.parametrize("buffer", [pytest.param("locked", marks=needs_torch), "numpy"])
@pytest.mark.parametrize("batch", [0, 16])
def test_random_small_requests_are_counted(tmp_path, batch, buffer):
    """--pattern rand: each timed loop is --ops requests of --io-size at random aligned
    offsets, started one call each or in batches; the figures count them, and the
    folder is left as it was. (On a numpy buffer, the default without torch, making the
    file used to fail: numpy's ``view()`` takes a dtype, torch's a shape.)"""
    out = tmp_path / "b.json"
    result = run_cli("bench", "--folder", tmp_path, "--pattern", "rand", "--io-size", "4K",
                     "--file-size", "1M", "--ops", 64, "--batch", batch, "--loops", 2,
                     "--buffer", buffer, "--json", out)
    assert result.returncode == 0, result.stderr
    assert "random 4K requests" in result.stdout and "requests/s" in result.stdout
    summary = json.loads(out.read_text())
    for job in ("write", "read"):
        figures = summary["jobs"][job]
        assert figures["loops"] == 2 and figures["bytes"] == 2 * 64 * 4096
        seconds = sum(summary["ranks"][0]["jobs"][job]["task_seconds"])
        assert figures["ops_per_s"] == pytest.approx(2 * 64 / seconds)
    assert sorted(os.listdir(tmp_path)) == ["b.json"]


def test_random_options_are_checked(tmp_path):
    for args, message in ((("--batch", 8), "go with --pattern rand"),
                          (("--pattern", "rand", "--io-size", "5000"), "multiple of 4096"),
                          (("--pattern", "rand", "--validate"), "without --validate"),
                          (("--pattern", "rand", "--io-size", "1M", "--file-size", "64K"),
                           "smaller than --io-size")):
        result = run_cli("bench", "--folder", tmp_path, *args)
        assert result.returncode == 2 and message in result.stderr, (args, result.stderr)


@needs_torch
def test_table_columns_stay_apart_whatever_the_figures(tmp_path):
    """A run of one byte takes a scheduler tick of CPU over almost nothing: its CPU s/GB
    (or any figure too wide for its column) is printed shorter, never run into the next."""
    import io

    from nvmeswap.cli.bench_summary import print_report
    out = tmp_path / "b.json"
    result = run_cli("bench", "--folder", tmp_path, "--io-size", "1", "--loops", 1,
                     "--warmup-loops", 0, "--json", out)
    assert result.returncode == 0, result.stderr
    summary = json.loads(out.read_text())
    summary["jobs"]["write"].update(cpu_seconds_per_gb=12345678.9, latency_p99_s=123456.0)
    summary["jobs"]["read"].update(cpu_seconds_per_gb=0.0123, gb_per_s=123456789.0)
    table = io.StringIO()
    print_report(summary, out=table)
    rows = {line.split()[0]: line.split() for line in table.getvalue().splitlines()
            if line.split()[:2] in (["write", "all"], ["read", "all"])}
    assert rows["write"][6] == "1.2e+07" and rows["write"][5] == "1.2e+08"
    assert rows["read"][3] == "1.2e+08" and rows["read"][6] == "0.012"
    assert all(len(row) == 8 and row[7] == "1" for row in rows.values())
