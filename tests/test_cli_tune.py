"""``nvmeswap tune``: JSON alone on standard output, a progress bar with an ETA, Ctrl-C keeps
the best so far, one colour scale over the heat map's panels and the pick marked."""
import fcntl
import json
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time

import pytest
from conftest import needs_torch

from nvmeswap.cli import tune


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "nvmeswap", *map(str, args)],
                          capture_output=True, text=True, timeout=240, check=False)


@needs_torch
def test_json_alone_on_stdout_prose_on_stderr(tmp_path):
    result = run_cli("tune", "--folder", tmp_path, "--io-size", "1M", "--loops", 1,
                     "--budget-seconds", 1)
    assert result.returncode == 0, result.stderr
    tuned = json.loads(result.stdout)              # nothing else on standard output
    assert tuned["interrupted"] is False
    assert "best combined" in result.stderr and "GB = 10^9 bytes" in result.stderr
    best = max(tuned["measurements"], key=lambda m: m["combined"])
    assert tuned["combined"]["gb_per_s"] == best["combined"]
    assert tuned["aio"] == {k: tuned["combined"][k] for k in tuned["aio"]}
    assert os.listdir(tmp_path) == []


def test_refusals_before_any_measuring(tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    twice = run_cli("tune", "--folder", tmp_path, "--folder", other)
    assert twice.returncode == 2 and "never be used" in twice.stderr and str(other) in twice.stderr
    bad_json = run_cli("tune", "--folder", tmp_path, "--json", tmp_path / "no" / "t.json")
    assert bad_json.returncode == 2 and bad_json.stdout == ""
    assert "--json" in bad_json.stderr and "does not exist" in bad_json.stderr
    bad_plot = run_cli("tune", "--folder", tmp_path, "--plot", other)
    assert bad_plot.returncode == 2 and "--plot" in bad_plot.stderr
    budget = run_cli("tune", "--folder", tmp_path, "--budget-seconds", "0")
    assert budget.returncode == 2 and "argument --budget-seconds: must be more than 0" \
        in budget.stderr
    assert sorted(os.listdir(tmp_path)) == ["other"]


@needs_torch
def test_sizes_that_do_not_fit_and_unused_options_are_refused(tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    # Sizes that do not fit: refused up front (a 4 TiB one was an OOM kill, no word).
    huge = run_cli("tune", "--folder", tmp_path, "--io-size", "4T")
    assert huge.returncode == 2 and "lower --io-size" in huge.stderr, huge.stderr
    rand = run_cli("tune", "--folder", tmp_path, "--pattern", "rand", "--file-size", "4000T")
    assert rand.returncode == 2 and "free; the run needs" in rand.stderr, rand.stderr
    stripes = run_cli("bench", "--stripe", f"{tmp_path},{other}", "--io-size", "4T")
    assert stripes.returncode == 2 and "lower --io-size" in stripes.stderr, stripes.stderr
    # Options that would be accepted and ignored are refused, naming what they go with.
    for args, message in (
            (("bench", "--ops", "16"), "--ops go with --pattern rand"),
            (("bench", "--stripe-size", "8K"), "--stripe-size goes with --stripe"),
            (("tune", "--ops", "16"), "--ops go with --pattern rand"),
            (("tune", "--pattern", "rand", "--budget-seconds", "5"),
             "--budget-seconds go with --pattern seq")):
        ignored = run_cli(*args, "--folder", tmp_path)
        assert ignored.returncode == 2 and message in ignored.stderr, (args, ignored.stderr)
    assert sorted(os.listdir(tmp_path)) == ["other"] and os.listdir(other) == []


@needs_torch
def test_ctrl_c_keeps_the_best_so_far(tmp_path):
    """On a terminal the bar counts configurations with an ETA; once it shows one measured,
    Ctrl-C stops the tuner, which writes the best of what it measured and says so."""
    out = tmp_path / "t.json"
    primary, secondary = pty.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    process = subprocess.Popen([sys.executable, "-m", "nvmeswap", "tune", "--folder",
                                str(tmp_path), "--io-size", "1M", "--loops", "1",
                                "--exhaustive", "--json", str(out)],
                               stdout=subprocess.PIPE, stderr=secondary,
                               start_new_session=True)
    seen, measured = b"", 0
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        ready, _, _ = select.select([primary], [], [], 0.1)
        if ready:
            seen += os.read(primary, 65536)
            counts = re.findall(rb"tune:.*?(\d+)/(\d+) \[", seen)
            if counts and int(counts[-1][0]) >= 2:
                measured = int(counts[-1][0])
                break
    assert measured, seen.decode(errors="replace")
    assert re.search(rb"<\d\d:\d\d", seen)                      # tqdm's ETA
    os.killpg(process.pid, signal.SIGINT)
    while process.poll() is None:
        ready, _, _ = select.select([primary], [], [], 0.1)
        if ready:
            seen += os.read(primary, 65536)
    os.close(secondary)
    os.close(primary)
    process.stdout.close()
    assert process.returncode == 130
    assert b"Traceback" not in seen and b"interrupted" in seen
    tuned = json.loads(out.read_text())
    assert tuned["interrupted"] is True
    assert measured <= tuned["configurations_measured"] < len(tune.full_grid())
    best = max(tuned["measurements"], key=lambda m: m["combined"])
    assert tuned["combined"]["gb_per_s"] == best["combined"]
    assert tuned["aio"] == {k: best[k] for k in tuned["aio"]}
    assert os.listdir(tmp_path) == ["t.json"]


def _results():
    # Two parallelisms with rates far apart: separate scales would hide the difference.
    return {(tune.BLOCK_SIZES[0], 4, 1, False, True): {"combined": 1.0, "read": 1, "write": 1},
            (tune.BLOCK_SIZES[2], 32, 1, False, True): {"combined": 2.0, "read": 2, "write": 2},
            (tune.BLOCK_SIZES[1], 8, 2, False, True): {"combined": 7.0, "read": 7, "write": 7},
            (tune.BLOCK_SIZES[1], 8, 2, True, True): {"combined": 5.0, "read": 5, "write": 5}}


def test_heat_map_grids_share_one_scale():
    grids, scale = tune.heat_map_grids(_results())
    assert scale == (1.0, 7.0)
    assert sorted(grids) == [1, 2]
    assert grids[2][tune.QUEUE_DEPTHS.index(8), 1] == 7.0       # the best of the modes
    assert grids[1][tune.QUEUE_DEPTHS.index(32), 2] == 2.0


def test_heat_map_one_colour_scale_and_the_pick_marked(tmp_path):
    """Drawn in a process of its own (matplotlib keeps font files open for good)."""
    pytest.importorskip("matplotlib")
    png = tmp_path / "map.png"
    code = """
import json, sys
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
from nvmeswap.cli import tune
made = []
original = plt.subplots
def keep(*args, **kwargs):
    made.append(original(*args, **kwargs))
    return made[-1]
plt.subplots = keep
results = {tuple(json.loads(k)): v for k, v in json.loads(sys.argv[1]).items()}
tune.plot_heat_map(results, sys.argv[2], winner=tuple(json.loads(sys.argv[3])))
figure, axes = made[0]
print(json.dumps({"limits": [list(axis.images[0].get_clim()) for axis in axes[0]],
                  "outlined": [[axis.get_title(), [list(p.get_xy()) for p in axis.patches]]
                               for axis in axes[0]],
                  "axes": len(figure.axes)}))
"""
    results = json.dumps({json.dumps(list(k)): v for k, v in _results().items()})
    winner = json.dumps([tune.BLOCK_SIZES[1], 8, 2, False, True])
    drawn = subprocess.run([sys.executable, "-c", code, results, str(png), winner],
                           capture_output=True, text=True, timeout=120, check=False)
    assert drawn.returncode == 0, drawn.stderr
    figures = json.loads(drawn.stdout)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert figures["limits"] == [[1.0, 7.0], [1.0, 7.0]]         # one scale for both panels
    assert figures["outlined"] == [["intra_op_parallelism=1", []],
                                   ["intra_op_parallelism=2 (pick outlined)", [[0.5, 0.5]]]]
    assert figures["axes"] == 3                                 # two panels, one colour bar
