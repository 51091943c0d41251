"""The nvmeswap command: bench, tune and report on a small folder, their JSON and exit codes."""
import json
import os
import subprocess
import sys

import pytest
from conftest import needs_torch, torch_sees_a_gpu, without_file_privileges

import nvmeswap


def nvmeswap_command(*args, cwd=None, prefix=()):
    result = subprocess.run([*prefix, sys.executable, "-m", "nvmeswap", *map(str, args)],
                            capture_output=True, text=True, timeout=240, cwd=cwd, check=False)
    return result


def test_bench_json_and_ds_io_lines(tmp_path):
    out = tmp_path / "bench.json"
    result = nvmeswap_command("bench", "--folder", tmp_path, "--io-size", "3M", "--loops", 2,
                              "--validate", "--intra-op-parallelism", 2, "--json", out)
    assert result.returncode == 0, result.stderr
    for job in ("Read", "Write"):
        for line in (f"Task {job} Speed = ", f"E2E {job} Speed = ", f"Task {job} Latency = "):
            assert line in result.stdout
    summary = json.loads(out.read_text())
    assert set(summary["jobs"]) == {"write", "read"}
    for figures in summary["jobs"].values():
        assert figures["gb_per_s"] > 0 and figures["bytes_per_loop"] == 3 << 20
        assert figures["latency_p50_s"] <= figures["latency_p99_s"]
    assert summary["config"]["handle"] == {"intra_op_parallelism": 2}
    assert os.listdir(tmp_path) == ["bench.json"]       # its data files are gone


@pytest.mark.parametrize("buffer", [pytest.param("plain", marks=needs_torch), "numpy"])
def test_bench_two_ranks_read_only(tmp_path, buffer):
    out = tmp_path / "ranks.json"
    result = nvmeswap_command("bench", "--folder", tmp_path, "--io-size", "1M", "--read",
                              "--ranks", 2, "--buffer", buffer, "--loops", 1, "--json", out)
    assert result.returncode == 0, result.stderr
    summary = json.loads(out.read_text())
    assert list(summary["jobs"]) == ["read"]
    assert [r["rank"] for r in summary["ranks"]] == [0, 1]
    assert len({r["file"] for r in summary["ranks"]}) == 2
    assert len(summary["jobs"]["read"]["per_rank_gb_per_s"]) == 2


def test_bench_default_folder_is_removed(tmp_path):
    result = nvmeswap_command("bench", "--io-size", "1M", "--loops", 1, "--warmup-loops", 0,
                              cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert os.listdir(tmp_path) == []


def test_bench_config_file(tmp_path):
    config = tmp_path / "tuned.json"
    config.write_text(json.dumps({"aio": {"block_size": "256K", "queue_depth": 8,
                                          "single_submit": "true", "overlap_events": "false",
                                          "num_threads": 2}}))
    out = tmp_path / "b.json"
    result = nvmeswap_command("bench", "--folder", tmp_path, "--io-size", "1M", "--loops", 1,
                              "--config", config, "--json", out)
    assert result.returncode == 0, result.stderr
    assert json.loads(out.read_text())["config"]["handle"] == {
        "block_size": 262144, "queue_depth": 8, "single_submit": True,
        "overlap_events": False, "intra_op_parallelism": 2}
    result = nvmeswap_command("bench", "--folder", tmp_path, "--io-size", "1M", "--loops", 1,
                              "--config", config, "--no-single-submit", "--json", out)
    assert result.returncode == 0, result.stderr
    assert json.loads(out.read_text())["config"]["handle"]["single_submit"] is False
    config.write_text(json.dumps({"aio": {"engine": "nope"}}))     # named by where it is
    result = nvmeswap_command("bench", "--folder", tmp_path, "--config", config)
    assert result.returncode == 2 and result.stderr.strip() == (
        f"nvmeswap bench: --config {config}: engine nope: engine must be one of aio, "
        "uring, auto, got 'nope'")


def test_bench_refuses_settings_out_of_range_before_any_work(tmp_path):
    for option, value in (("--intra-op-parallelism", 1000), ("--queue-depth", 1025),
                          ("--block-size", "3G")):
        result = nvmeswap_command("bench", "--folder", tmp_path, "--io-size", "1M", option,
                                  value)
        assert result.returncode == 2, (option, result.stderr)
        assert f"nvmeswap bench: {option}: " in result.stderr and "must be between" in \
            result.stderr
    result = nvmeswap_command("bench", "--folder", tmp_path, "--io-size", "4K", "--pattern",
                              "rand", "--file-size", "1M", "--batch", 300)
    assert result.returncode == 2 and "--batch 300 requests of --io-size 4096 do not fit" \
        in result.stderr
    config = tmp_path / "deep.json"
    config.write_text('{"aio": {"queue_depth": 5000}}')
    result = nvmeswap_command("bench", "--folder", tmp_path, "--io-size", "1M", "--config",
                              config)
    assert result.returncode == 2
    assert f"--config {config}: queue_depth must be between 1 and 1024" in result.stderr
    config.write_text('{"aio": null}')
    result = nvmeswap_command("bench", "--folder", tmp_path, "--io-size", "1M", "--config",
                              config)
    assert result.returncode == 2 and '"aio" section must be a dict' in result.stderr
    assert os.listdir(tmp_path) == ["deep.json"]


@needs_torch
def test_bench_stripe_read_only_to_json(tmp_path):
    folders = [tmp_path / "d0", tmp_path / "d1"]
    for folder in folders:
        folder.mkdir()
    out = tmp_path / "stripe.json"
    result = nvmeswap_command("bench", "--stripe", ",".join(map(str, folders)), "--io-size",
                              "2M", "--stripe-size", "256K", "--loops", 1, "--read",
                              "--json", out)
    assert result.returncode == 0, result.stderr
    summary = json.loads(out.read_text())
    assert [device["folder"] for device in summary["devices"]] == list(map(str, folders))
    assert all(set(device) == {"folder", "read"} and device["read"] > 0
               for device in summary["devices"])
    assert summary["sum_of_devices"]["read"] == pytest.approx(
        sum(device["read"] for device in summary["devices"]))
    assert summary["striped_over_sum"]["read"] == pytest.approx(
        summary["striped"]["read"] / summary["sum_of_devices"]["read"])
    assert "write" not in result.stdout and "striped / sum" in result.stdout
    assert all(os.listdir(folder) == [] for folder in folders)
    for extra in (["--ranks", "2"], ["--validate"], ["--folder", str(tmp_path)]):
        refused = nvmeswap_command("bench", "--stripe", ",".join(map(str, folders)),
                                   "--io-size", "1M", *extra)
        assert refused.returncode == 2 and f"drop {extra[0]}" in refused.stderr, extra


def test_bench_errors(tmp_path):
    missing = nvmeswap_command("bench", "--folder", tmp_path / "nope", "--io-size", "1M")
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    too_big = nvmeswap_command("bench", "--folder", tmp_path, "--io-size", "64T")
    assert too_big.returncode == 2 and "free" in too_big.stderr
    assert os.listdir(tmp_path) == []
    if not torch_sees_a_gpu():
        gpu = nvmeswap_command("bench", "--folder", tmp_path, "--io-size", "1M", "--gpu")
        assert gpu.returncode == 2 and "need a CUDA GPU" in gpu.stderr
        pinned = nvmeswap_command("bench", "--folder", tmp_path, "--io-size", "1M",
                                  "--buffer", "pinned")
        assert pinned.returncode == 2 and "--buffer pinned needs a CUDA GPU" in pinned.stderr
    bad_size = nvmeswap_command("bench", "--folder", tmp_path, "--io-size", "lots")
    assert bad_size.returncode == 2 and "not a size" in bad_size.stderr


def test_bench_and_tune_refuse_an_unwritable_folder(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    prefix = without_file_privileges()
    bench = nvmeswap_command("bench", "--folder", locked, "--io-size", "1M", prefix=prefix)
    assert bench.returncode == 2 and "not writable" in bench.stderr
    tune = nvmeswap_command("tune", "--folder", locked, "--io-size", "1M", prefix=prefix)
    assert tune.returncode == 2 and "not writable" in tune.stderr


@needs_torch
def test_tune_json_feeds_from_config(tmp_path):
    out = tmp_path / "tune.json"
    result = nvmeswap_command("tune", "--folder", tmp_path, "--io-size", "2M", "--loops", 1,
                              "--json", out)
    assert result.returncode == 0, result.stderr
    tuned = json.loads(out.read_text())
    section = tuned["aio"]
    assert isinstance(section["single_submit"], bool)
    assert isinstance(section["overlap_events"], bool)
    assert tuned["combined"]["gb_per_s"] > 0 and tuned["configurations_measured"] >= 5
    with nvmeswap.aio_handle.from_config(tuned) as handle:
        assert handle.get_block_size() == section["block_size"]
        assert handle.get_queue_depth() == section["queue_depth"]
        assert handle.get_intra_op_parallelism() == section["intra_op_parallelism"]
    assert os.listdir(tmp_path) == ["tune.json"]


def test_tune_missing_folder(tmp_path):
    result = nvmeswap_command("tune", "--folder", tmp_path / "nope")
    assert result.returncode == 2 and "does not exist" in result.stderr


def test_report_json(tmp_path):
    out = tmp_path / "report.json"
    result = nvmeswap_command("report", "--folder", tmp_path, "--json", out)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert report["usable"] is True
    names = [c["name"] for c in report["checks"]]
    for expected in ("kernel AIO", "aio-max-nr", "ulimit -l", "io_uring", "CUDA", "cuFile",
                     f"folder {tmp_path}", f"O_DIRECT in {tmp_path}"):
        assert expected in names
    assert os.listdir(tmp_path) == ["report.json"]


def test_report_missing_folder_fails_with_a_fix(tmp_path):
    out = tmp_path / "report.json"
    result = nvmeswap_command("report", "--folder", tmp_path / "nope", "--json", out)
    assert result.returncode == 1 and "[FAIL]" in result.stdout
    failed = [c for c in json.loads(out.read_text())["checks"] if c["status"] == "fail"]
    assert failed and failed[0]["fix"].startswith("mkdir")


@needs_torch
def test_a_heat_map_on_a_full_disk_fails_in_one_line(tmp_path, small_filesystem):
    """--plot on a full disk: the results are printed and the JSON written, one line names
    the file and the cause, exit 1; no traceback and no half-written picture."""
    with open(small_filesystem / "filler", "wb") as filler, \
            pytest.raises(OSError, match="No space left"):
        while True:
            filler.write(b"\0" * (64 << 10))
            filler.flush()
    out, png = tmp_path / "tune.json", small_filesystem / "landscape.png"
    result = nvmeswap_command("tune", "--folder", tmp_path, "--io-size", "1M", "--loops", 1,
                              "--budget-seconds", 1, "--json", out, "--plot", png)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr and "best combined" in result.stderr
    assert f"nvmeswap tune: --plot {png}: No space left on device" in \
        result.stderr.splitlines()
    assert json.loads(out.read_text())["configurations_measured"] >= 1
    assert not png.exists() or png.stat().st_size == 0


@pytest.mark.parametrize("command", ["report", "bench", "tune"])
def test_a_file_given_as_folder_is_named_as_such(tmp_path, command):
    """--folder naming a regular file: "is not a folder", never "does not exist" with a
    mkdir that would fail."""
    path = tmp_path / "a-file"
    path.write_bytes(b"x")
    result = nvmeswap_command(command, "--folder", path)
    assert result.returncode == (1 if command == "report" else 2), result.stderr
    assert "is not a folder" in result.stdout + result.stderr
    assert "does not exist" not in result.stdout + result.stderr and "mkdir" not in \
        result.stdout + result.stderr
    assert path.read_bytes() == b"x"


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize(("command", "printed"), [
    (("report",), "nvmeswap can work here"),
    (("bench", "--io-size", "1M", "--loops", 1, "--buffer", "numpy"), "Task Read Speed"),
    pytest.param(("bench", "--stripe", "{folder}/a,{folder}/b", "--io-size", "1M",
                  "--loops", 1), "striped / sum", marks=needs_torch),
    pytest.param(("tune", "--io-size", "1M", "--loops", 1, "--budget-seconds", 1),
                 "best combined", marks=needs_torch),
    pytest.param(("tune", "--pattern", "rand", "--file-size", "1M", "--ops", 16, "--loops", 1),
                 "best:", marks=needs_torch),
], ids=["report", "bench", "bench-stripe", "tune", "tune-rand"])
def test_a_json_file_that_cannot_be_written_fails_in_one_line(tmp_path, command, printed):
    """A full disk under --json: the results are still printed, one line names the file
    and the cause, and the exit status is 1; no traceback."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    name, *options = (str(part).format(folder=tmp_path) for part in command)
    folder = [] if "--stripe" in options else ["--folder", tmp_path]
    result = nvmeswap_command(name, *folder, *options, "--json", "/dev/full")
    assert result.returncode == 1, result.stderr
    assert printed in result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert f"nvmeswap {name}: --json /dev/full: No space left on device" in \
        result.stderr.splitlines()


@needs_torch
def test_tune_plot(tmp_path):
    png = tmp_path / "landscape.png"
    result = nvmeswap_command("tune", "--folder", tmp_path, "--io-size", "1M", "--loops", 1,
                              "--budget-seconds", 1, "--plot", png)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert result.returncode == 2 and "needs matplotlib" in result.stderr
        assert not png.exists()
    else:
        assert result.returncode == 0, result.stderr
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
