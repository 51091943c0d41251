"""``nvmeswap tune --pattern rand``: engine x batch size for small random reads."""
import json
import os
import subprocess
import sys

from conftest import needs_torch, package_env

from nvmeswap.cli import tune_random

pytestmark = needs_torch      # tune measures the handle's locked tensors


def _tune(*args):
    return subprocess.run([sys.executable, "-m", "nvmeswap", "tune", *map(str, args)],
                          capture_output=True, text=True, timeout=300, check=False,
                          env=package_env())


def test_tune_rand_measures_every_engine_and_batch_and_picks_the_fastest(tmp_path):
    result = _tune("--folder", tmp_path, "--pattern", "rand", "--file-size", "8M",
                   "--ops", 256, "--loops", 1, "--engine", "aio")
    assert result.returncode == 0, result.stderr
    tuned = json.loads(result.stdout)
    measured = tuned["measurements"]
    assert [(m["engine"], m["batch"]) for m in measured] == \
        [("aio", batch) for batch in tune_random.BATCHES]
    assert all(m["reads_per_s"] > 0 and m["loops"] == 1 for m in measured)
    assert tuned["best"] == max(measured, key=lambda m: m["reads_per_s"])
    assert tuned["io_size"] == 4096 and tuned["file_size"] == 8 << 20
    assert f"best: engine=aio, batch {tuned['best']['batch']}" in result.stderr
    assert os.listdir(tmp_path) == []       # its file and folder are gone


def test_tune_rand_refuses_what_it_cannot_measure(tmp_path):
    for args, says in [(("--io-size", "1000"), "multiple of 4096"),
                       (("--file-size", "2K"), "--file-size of at least"),
                       (("--exhaustive",),
                        "--exhaustive, --plot and --budget-seconds go with --pattern seq")]:
        result = _tune("--folder", tmp_path, "--pattern", "rand", *args)
        assert result.returncode != 0 and says in result.stderr, result.stderr
    seq = _tune("--folder", tmp_path, "--file-size", "8M")
    assert seq.returncode != 0 and "--file-size and --ops go with --pattern rand" in seq.stderr
