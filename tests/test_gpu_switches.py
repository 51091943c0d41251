"""Switches that hide cuFile (issue: no way to turn it off), against stand-in libraries
built by the test: no GPU is needed."""
import os
import subprocess
import sys

import pytest
from conftest import needs_torch, package_env
from fake_gpu import FAKE_CUDA, FAKE_CUFILE, build

import nvmeswap

ASK = "import nvmeswap; print(nvmeswap.gds_available(), nvmeswap.gds_unavailable_reason())"


def _answer(library_folder, **environment):
    """What a fresh process says of cuFile, with a loadable stand-in cuFile and driver
    where the dynamic loader looks by default."""
    env = package_env(LD_LIBRARY_PATH=str(library_folder), **environment)
    for name in ("NVMESWAP_GDS", "NVMESWAP_CUFILE_LIBRARY", "NVMESWAP_CUDA_LIBRARY"):
        if name not in environment:
            env.pop(name, None)
    result = subprocess.run([sys.executable, "-c", ASK], capture_output=True, text=True,
                            env=env, check=False)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_cufile_can_be_switched_off(tmp_path):
    build(tmp_path, "libcufile.so.0", FAKE_CUFILE)
    build(tmp_path, "libcuda.so.1", FAKE_CUDA)
    assert _answer(tmp_path) == "True"      # found where the loader looks
    assert _answer(tmp_path, NVMESWAP_GDS="0") == "False NVMESWAP_GDS=0 hides cuFile"
    assert _answer(tmp_path, NVMESWAP_CUFILE_LIBRARY="none") == \
        "False NVMESWAP_CUFILE_LIBRARY=none hides cuFile"


def test_a_cufile_path_that_cannot_be_loaded_is_not_replaced_by_another(tmp_path):
    """It used to go on to the loader's libcufile.so.0: a wrong path then silently
    used whatever cuFile the machine had."""
    build(tmp_path, "libcufile.so.0", FAKE_CUFILE)
    build(tmp_path, "libcuda.so.1", FAKE_CUDA)
    missing = tmp_path / "elsewhere" / "libcufile.so.0"
    said = _answer(tmp_path, NVMESWAP_CUFILE_LIBRARY=str(missing))
    assert said.startswith("False cuFile could not be loaded") and str(missing) in said


def test_report_says_cufile_is_hidden_and_by_what():
    env = package_env(NVMESWAP_GDS="0")
    result = subprocess.run([sys.executable, "-m", "nvmeswap", "report"], capture_output=True,
                            text=True, env=env, timeout=120, check=False)
    assert "cuFile: hidden: NVMESWAP_GDS=0 hides cuFile" in result.stdout + result.stderr


@needs_torch
def test_locked_tensors_are_registered_with_cuda_only_where_it_is_in_use(monkeypatch):
    """Where CUDA is in use, a locked tensor is cudaHostRegister'ed (pinned-speed copies);
    never where it is not (no CUDA initialised for it); NVMESWAP_REGISTER_LOCKED=0 and
    DeepSpeed's DS_PIN_MEMORY_REGISTER_DEVICE=0 turn it off. (Real registration, and the
    copy speed it buys, are tested in test_gpu.py on a GPU.)"""
    import torch

    from nvmeswap import locked_tensors
    registered = []
    monkeypatch.setattr(locked_tensors, "register_for_device_copies", registered.append)
    with nvmeswap.aio_handle() as h:
        def made():
            count = len(registered)
            tensor = h.new_cpu_locked_tensor(1000, torch.empty(0))
            assert h.free_cpu_locked_tensor(tensor)
            return len(registered) - count

        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
        assert made() == 0
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        assert made() == 1
        for name in ("NVMESWAP_REGISTER_LOCKED", "DS_PIN_MEMORY_REGISTER_DEVICE"):
            monkeypatch.setenv(name, "0")
            assert made() == 0
            monkeypatch.delenv(name)


def test_report_says_whether_cufile_takes_files_in_the_folder(tmp_path):
    libraries = tmp_path / "libraries"
    libraries.mkdir()
    cufile = build(libraries, "libcufile.so.0", FAKE_CUFILE)
    driver = build(libraries, "libcuda.so.1", FAKE_CUDA)
    folder = tmp_path / "data"
    folder.mkdir()
    env = package_env(NVMESWAP_CUFILE_LIBRARY=str(cufile), NVMESWAP_CUDA_LIBRARY=str(driver))
    env.pop("NVMESWAP_GDS", None)

    def report(**extra):
        result = subprocess.run([sys.executable, "-m", "nvmeswap", "report", "--folder",
                                 str(folder)], capture_output=True, text=True,
                                env={**env, **extra}, timeout=120, check=False)
        return result.stdout + result.stderr

    assert f"cuFile in {folder}: registers files here" in report()
    assert f"cuFile in {folder}: refuses files here (CU_FILE_HANDLE_NOT_REGISTERED)" in \
        report(FAKE_CUFILE_REFUSE_FILES="5027")
    assert os.listdir(folder) == []     # its probe file is gone


@pytest.mark.parametrize("name", ["NVMESWAP_GDS", "NVMESWAP_DEEPSPEED",
                                  "NVMESWAP_REGISTER_LOCKED", "DS_PIN_MEMORY_REGISTER_DEVICE"])
def test_a_switch_set_to_what_it_does_not_take_is_named(name):
    """An on/off variable set to anything but 1, true, yes, on, 0, false, no or off (a
    typo: "disabled") is an error naming it where it is read, and report's [FAIL]; it
    never passes for the default."""
    from nvmeswap.environment import switch

    expected = f"{name}='disabled': expected 1, true, yes or on, or 0, false, no or off"
    for value, answer in (("On", True), (" 0 ", False), ("", None)):
        os.environ[name] = value
        try:
            assert switch(name) is answer
        finally:
            del os.environ[name]
    env = package_env(**{name: "disabled"})
    ask = {"NVMESWAP_GDS": "import nvmeswap; nvmeswap.gds_available()",
           "NVMESWAP_DEEPSPEED": "import nvmeswap.deepspeed as d; d.switched_on()",
           "NVMESWAP_REGISTER_LOCKED": "import nvmeswap.locked_tensors as t; "
                                       "t.register_with_cuda()",
           "DS_PIN_MEMORY_REGISTER_DEVICE": "import nvmeswap.locked_tensors as t; "
                                            "t.register_with_cuda()"}[name]
    asked = subprocess.run([sys.executable, "-c", ask], capture_output=True, text=True,
                           env=env, timeout=120, check=False)
    assert asked.returncode == 1 and f"ValueError: {expected}" in asked.stderr, asked.stderr
    report = subprocess.run([sys.executable, "-m", "nvmeswap", "report"], capture_output=True,
                            text=True, env=env, timeout=120, check=False)
    assert report.returncode == 1 and f"[FAIL] {name}: {expected}" in report.stdout
    assert "Traceback" not in report.stderr


def test_the_deepspeed_startup_line_names_a_switch_value_it_does_not_take():
    """The startup file's line runs at every interpreter start: a value of the switch it
    does not take is said on standard error, and the interpreter goes on."""
    from nvmeswap.deepspeed import STARTUP_LINE

    started = subprocess.run([sys.executable, "-c", STARTUP_LINE + "print('went on')"],
                             capture_output=True, text=True, timeout=120, check=False,
                             env=package_env(NVMESWAP_DEEPSPEED="enabled"))
    assert started.returncode == 0 and started.stdout.strip() == "went on"
    assert "NVMESWAP_DEEPSPEED='enabled': expected" in started.stderr
