"""The command line's surface: --version, help with a text and a default for every option,
bare ``nvmeswap``, Ctrl-C, ``report``'s versions and its honest page-lock check, and the
package and command line working where torch cannot be imported."""
import json
import re
import shutil
import subprocess
import sys

import pytest
from conftest import needs_torch

import nvmeswap
from nvmeswap.cli.main import build_parser

# Runs the rest of the command line with `import torch` failing, as on a machine without it.
WITHOUT_TORCH = ("import sys; sys.modules['torch'] = None; "
                 "from nvmeswap.cli.main import main; sys.exit(main(sys.argv[1:]))")


def run_cli(*args, code=None, prefix=()):
    program = ["-c", code] if code else ["-m", "nvmeswap"]
    return subprocess.run([*prefix, sys.executable, *program, *map(str, args)],
                          capture_output=True, text=True, timeout=240, check=False)


def test_version_comes_from_one_place():
    result = run_cli("--version")
    assert result.returncode == 0 and result.stdout.strip() == f"nvmeswap {nvmeswap.__version__}"
    from importlib.metadata import version
    assert version("nvmeswap") == nvmeswap.__version__


def test_bare_command_prints_help():
    result = run_cli()
    assert result.returncode == 0 and result.stderr == ""
    assert result.stdout.startswith("usage: nvmeswap")
    for command in ("bench", "tune", "report"):
        assert re.search(rf"^\s+{command}\s+\S", result.stdout, re.MULTILINE)


def _options():
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command")
    for name, sub in commands.choices.items():
        for action in sub._actions:
            if action.option_strings and action.dest != "help":
                yield name, sub, action


@pytest.mark.parametrize("command", ["bench", "tune", "report"])
def test_every_option_has_help_and_its_default(command):
    """Each option's help line, as `nvmeswap COMMAND --help` prints it, has a text and, for
    all but flags (off unless given) and required options, the default."""
    result = run_cli(command, "--help")
    assert result.returncode == 0
    printed = " ".join(result.stdout.split())
    options = [(sub, action) for name, sub, action in _options() if name == command]
    assert options
    for sub, action in options:
        expanded = " ".join(sub._get_formatter()._expand_help(action).split())
        assert len(expanded) > 10, f"{command} {action.option_strings[0]} has no help"
        assert expanded in printed
        if action.nargs != 0 and not action.required:
            assert "default" in expanded, \
                f"{command} {action.option_strings[0]} does not say its default"


def test_ctrl_c_without_traceback(tmp_path):
    """A KeyboardInterrupt anywhere in a command ends it with one line and status 130."""
    code = ("import sys; import nvmeswap.cli.report as report\n"
            "def interrupted(args): raise KeyboardInterrupt\n"
            "report.run = interrupted\n"
            "from nvmeswap.cli.main import main; sys.exit(main(sys.argv[1:]))")
    result = run_cli("report", code=code)
    assert result.returncode == 130
    assert result.stderr.strip().splitlines() == ["nvmeswap report: interrupted"]


def test_ctrl_c_python_drops_still_ends_the_command_with_130():
    """An interrupt that lands in a weakref callback is dropped by Python ("Exception
    ignored"); the command still ends with status 130, once it has finished."""
    code = ("import os, signal, sys, weakref\n"
            "import nvmeswap.cli.report as report\n"
            "class Thing: pass\n"
            "def dropped(args):\n"
            "    thing = Thing()\n"
            "    ref = weakref.ref(thing, lambda _: os.kill(os.getpid(), signal.SIGINT))\n"
            "    del thing\n"
            "    print('finished')\n"
            "    return 0\n"
            "report.run = dropped\n"
            "from nvmeswap.cli.main import command; sys.exit(command())")
    result = run_cli("report", code=code)
    assert result.stdout == "finished\n" and "Exception ignored" in result.stderr
    assert result.returncode == 130
    assert result.stderr.strip().splitlines()[-1] == "nvmeswap: interrupted"


@needs_torch
def test_ctrl_c_while_torch_loads_waits_until_it_is_loaded():
    """A Ctrl-C inside torch's import can abort the process (a C++ exception where none
    may pass): report holds SIGINT until torch is loaded, then stops with 130."""
    code = ("import os, signal, sys\n"
            "class InterruptAtDistributed:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'torch.distributed':\n"
            "            os.kill(os.getpid(), signal.SIGINT)\n"
            "sys.meta_path.insert(0, InterruptAtDistributed())\n"
            "from nvmeswap.cli.main import command\n"
            "code = command()\n"
            "torch = sys.modules.get('torch')\n"
            "print('torch loaded' if torch is not None and hasattr(torch, 'Tensor') else '-')\n"
            "sys.exit(code)")
    result = run_cli("report", code=code)
    assert result.returncode == 130 and result.stdout == "torch loaded\n"
    assert result.stderr.strip().splitlines() == ["nvmeswap report: interrupted"]


def test_report_prints_versions_and_build_tools(tmp_path):
    out = tmp_path / "r.json"
    result = run_cli("report", "--folder", tmp_path, "--json", out)
    assert result.returncode == 0, result.stderr
    versions = json.loads(out.read_text())["versions"]
    import platform

    import numpy
    try:
        import torch
        torch_version = torch.__version__
    except ImportError:
        torch_version = "not installed"
    assert versions["nvmeswap"] == nvmeswap.__version__
    assert versions["torch"] == torch_version and versions["numpy"] == numpy.__version__
    assert versions["Python"] == platform.python_version()
    assert versions["kernel"] == f"Linux {platform.release()}"
    assert re.fullmatch(r"\d+\.\d+\.\d+", versions["Cython"])
    assert versions["compiler"] != "unknown"
    first = result.stdout.splitlines()[0]
    assert first.startswith("versions: nvmeswap ") and versions["compiler"] in first


def _cap_ipc_lock_held():
    """Read here, not through the code under test: CapEff's bit 14."""
    with open("/proc/self/status") as f:
        capabilities = next(line for line in f if line.startswith("CapEff:"))
    return bool(int(capabilities.split()[1], 16) >> 14 & 1)


def test_report_reads_cap_ipc_lock_not_the_uid(tmp_path):
    """Without CAP_IPC_LOCK a small RLIMIT_MEMLOCK is a warning, even for root; with it,
    the report says the capability is why any amount may be locked."""
    if shutil.which("setpriv") is None or shutil.which("prlimit") is None:
        pytest.skip("setpriv and prlimit are needed to drop CAP_IPC_LOCK")
    out = tmp_path / "r.json"
    dropped = run_cli("report", "--json", out, prefix=(
        "setpriv", "--bounding-set", "-ipc_lock", "--inh-caps", "-ipc_lock",
        "prlimit", "--memlock=65536:65536"))
    assert dropped.returncode == 0, dropped.stderr
    checks = {c["name"]: c for c in json.loads(out.read_text())["checks"]}
    check = checks["ulimit -l"]
    assert check["status"] == "warn" and "64.0 KiB and no CAP_IPC_LOCK" in check["found"]
    assert "root" not in check["found"] and check["fix"]
    # io_uring's rings are charged to the same limit (or, with this user's other rings,
    # it refuses even the probe's: a warning either way).
    uring = checks["io_uring"]
    assert uring["status"] == "warn", uring
    if uring["found"].startswith("works"):
        assert "ulimit -l is 64.0 KiB with no CAP_IPC_LOCK" in uring["found"]
        assert uring["fix"].startswith("ulimit -l 8M")
    normal = run_cli("report", "--json", out)
    check = next(c for c in json.loads(out.read_text())["checks"] if c["name"] == "ulimit -l")
    assert normal.returncode == 0
    assert ("holds CAP_IPC_LOCK" in check["found"]) == _cap_ipc_lock_held()


def test_import_without_torch_moves_numpy_and_bytearray_data(tmp_path):
    """`import nvmeswap` loads no torch; a handle moves numpy and bytearray data without it."""
    code = f"""
import sys
sys.modules['torch'] = None
import numpy, nvmeswap
path = {str(tmp_path / 'f')!r}
data = numpy.random.default_rng(3).integers(0, 256, (1 << 20) + 7, dtype=numpy.uint8)
back = bytearray(data.size)
with nvmeswap.aio_handle(intra_op_parallelism=2) as handle:
    assert handle.sync_pwrite(data, path) == 1
    assert handle.sync_pread(back, path) == 1
assert bytes(back) == data.tobytes() and open(path, 'rb').read() == data.tobytes()
print('ok', 'torch' in sys.modules and sys.modules['torch'] is not None)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["ok", "False"]


def test_command_line_without_torch(tmp_path):
    bench = run_cli("bench", "--folder", tmp_path, "--io-size", "1M", "--loops", 1,
                    "--json", tmp_path / "b.json", code=WITHOUT_TORCH)
    assert bench.returncode == 0, bench.stderr
    summary = json.loads((tmp_path / "b.json").read_text())
    assert summary["config"]["buffer"] == "numpy" and set(summary["jobs"]) == {"write", "read"}
    assert "buffer numpy" in bench.stdout.splitlines()[0]
    locked = run_cli("bench", "--folder", tmp_path, "--buffer", "locked", code=WITHOUT_TORCH)
    assert locked.returncode == 2 and locked.stderr.strip().splitlines() == [
        ("nvmeswap bench: --buffer locked needs torch (pip install torch); "
         "--buffer numpy works without it")]
    tuned = run_cli("tune", "--folder", tmp_path, code=WITHOUT_TORCH)
    assert tuned.returncode == 2 and len(tuned.stderr.strip().splitlines()) == 1
    assert "tune needs torch" in tuned.stderr
    report = run_cli("report", "--json", tmp_path / "r.json", code=WITHOUT_TORCH)
    assert report.returncode == 0, report.stderr
    assert json.loads((tmp_path / "r.json").read_text())["versions"]["torch"] == "not installed"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.json", "r.json"]
