"""What pip and a packager see: one version, a LICENSE that matches the metadata, a
setuptools floor that reads that metadata, and an sdist that carries and collects its tests."""
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

import nvmeswap

ROOT = Path(__file__).resolve().parents[1]
try:
    import tomllib  # Python 3.11+
except ImportError:  # 3.9 and 3.10: its forerunner, where installed
    tomllib = pytest.importorskip("tomli", reason="reading pyproject.toml needs Python 3.11 "
                                  "or tomli")
pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())

# Files of the working tree that are outputs, not sources.
LEFT_OUT = shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__", "*.so",
                                  ".pytest_cache", ".benchmarks", "*.c")


@pytest.fixture(scope="module")
def sdist(tmp_path_factory):
    """The sdist built by the build backend the project names, from a copy of this tree."""
    work = tmp_path_factory.mktemp("sdist")
    source = work / "source"
    shutil.copytree(ROOT, source, ignore=LEFT_OUT)
    built = subprocess.run(
        [sys.executable, "-c", ("import sys; from setuptools import build_meta; "
                                "print(build_meta.build_sdist(sys.argv[1]))"), str(work / "dist")],
        cwd=source, capture_output=True, text=True, timeout=240, check=False)
    assert built.returncode == 0, built.stderr
    archive = work / "dist" / built.stdout.strip().splitlines()[-1]
    with tarfile.open(archive) as tar:
        # The "data" filter refuses links and paths out of the folder; Pythons before
        # 3.11.4 (and 3.10.12, 3.9.17) lack filters, and extract this archive of our own
        # making as it is.
        extra = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(work / "unpacked", **extra)
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    (top,) = (work / "unpacked").iterdir()
    return {"names": names, "top": top, "source": source}


def test_one_version_source(sdist):
    assert "version" not in pyproject["project"]
    assert pyproject["project"]["dynamic"] == ["version"]
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {
        "attr": "nvmeswap.__version__"}
    pkg_info = (sdist["top"] / "PKG-INFO").read_text()
    assert re.search(rf"^Version: {re.escape(nvmeswap.__version__)}$", pkg_info, re.MULTILINE)
    init = (ROOT / "nvmeswap" / "__init__.py").read_text()
    assert init.count(nvmeswap.__version__) == 1      # written once, nowhere else in the package


def test_license_file_matches_the_metadata(sdist):
    assert pyproject["project"]["license"] == "Apache-2.0"
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
    pkg_info = (sdist["top"] / "PKG-INFO").read_text()
    assert "License-Expression: Apache-2.0" in pkg_info and "License-File: LICENSE" in pkg_info
    assert (sdist["top"] / "LICENSE").read_text() == text


def test_setuptools_floor_reads_the_license_metadata():
    """An SPDX string in `license` and `license-files` need setuptools 77 or later."""
    floor = next(r for r in pyproject["build-system"]["requires"] if r.startswith("setuptools"))
    minimum = tuple(int(p) for p in re.fullmatch(r"setuptools>=([\d.]+)", floor)[1].split("."))
    assert minimum >= (77,)
    import setuptools
    installed = tuple(int(p) for p in re.findall(r"\d+", setuptools.__version__)[:2])
    assert installed >= minimum


def test_sdist_carries_tests_examples_and_bench(sdist):
    for folder in ("tests", "examples", "bench"):
        wanted = {str(p.relative_to(sdist["source"])) for p in (sdist["source"] / folder).rglob("*")
                  if p.suffix in (".py", ".md") and "__pycache__" not in p.parts}
        assert wanted and wanted <= sdist["names"], wanted - sdist["names"]
    for needed in ("LICENSE", "README.md", "setup.py", "pyproject.toml",
                   "cdeps/kernel_aio.h", "pyx/_queues.pyx", "pyx/_transfers.pyx",
                   "pyx/_transfer_steps.pxd", "pyx/nvmeswap/_transfers.pxd",
                   *(f"nvmeswap/{stub.name}" for stub in ROOT.glob("nvmeswap/*.pyi"))):
        assert needed in sdist["names"]


def test_sdist_collects_its_tests(sdist):
    """pytest, run inside the unpacked sdist (with this build's extensions beside it),
    collects every test module the tree has: none of them needs a file left out."""
    top = sdist["top"]
    for extension in (ROOT / "nvmeswap").glob("*.so"):
        shutil.copy(extension, top / "nvmeswap")
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-rs", "-p", "no:cacheprovider",
         "tests"], cwd=top, capture_output=True, text=True, timeout=240,
        env={**os.environ, "PYTHONPATH": str(top)}, check=False)
    assert collected.returncode == 0, collected.stdout + collected.stderr
    modules = {line.split("::")[0] for line in collected.stdout.splitlines() if "::" in line}
    # Modules that skip themselves whole (an optional peer missing, an opt-in test).
    modules |= set(re.findall(r"^SKIPPED \[\d+\] (tests/test_\w+\.py)", collected.stdout,
                              re.MULTILINE))
    expected = {f"tests/{p.name}" for p in (ROOT / "tests").glob("test_*.py")}
    assert modules == expected


def _public(names):
    return {name for name in names if not name.startswith("_")}


@pytest.mark.parametrize("extension", sorted(p.stem for p in (ROOT / "pyx").glob("_*.pyx")))
def test_each_extension_has_a_stub_naming_what_python_may_use(extension):
    """nvmeswap/<extension>.pyi, shipped beside it, names exactly the extension's public
    functions, classes and constants, and each class's public members."""
    import ast
    import importlib
    import inspect

    assert "*.pyi" in pyproject["tool"]["setuptools"]["package-data"]["nvmeswap"]
    module = importlib.import_module(f"nvmeswap.{extension}")
    stub = ast.parse((ROOT / "nvmeswap" / f"{extension}.pyi").read_text())
    assert ast.get_docstring(stub)
    stubbed = {node.name: node for node in stub.body
               if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    stubbed.update((node.target.id, node) for node in stub.body
                   if isinstance(node, ast.AnnAssign))
    defined = _public(name for name, value in vars(module).items()
                      if not inspect.ismodule(value)
                      and getattr(value, "__module__", module.__name__) == module.__name__)
    assert _public(stubbed) == defined
    for name in defined:
        if isinstance(stubbed[name], ast.ClassDef):
            members = _stub_members(stubbed[name], stub)
            assert _public(members) == _public(dir(getattr(module, name))), name
            bases = [base.id for base in stubbed[name].bases if isinstance(base, ast.Name)]
            assert bases == [base.__name__ for base in getattr(module, name).__bases__
                             if base is not object], name


def _stub_members(class_node, stub):
    """The methods and properties a stubbed class has, its stubbed bases' included (a base
    from another extension is found in that extension's stub)."""
    import ast

    members = {node.name for node in ast.walk(class_node) if isinstance(node, ast.FunctionDef)}
    for base in class_node.bases:
        if not isinstance(base, ast.Name):
            continue
        home = stub
        for node in stub.body:
            if isinstance(node, ast.ImportFrom) and any(a.name == base.id for a in node.names):
                home = ast.parse((ROOT / f"{node.module.replace('.', '/')}.pyi").read_text())
        found = [node for node in home.body
                 if isinstance(node, ast.ClassDef) and node.name == base.id]
        if found:
            members |= _stub_members(found[0], home)
    return members


def test_the_top_level_loads_its_modules_on_first_use():
    """Note [lazy top level] in nvmeswap/__init__.py: ``import nvmeswap`` loads no handle
    or checkpoint module; each public name loads its own, is what its module defines, and
    is listed by ``dir``; a name it does not have is an AttributeError."""
    code = """if True:
        import sys
        import nvmeswap
        loaded = sorted(m for m in sys.modules if m.startswith("nvmeswap."))
        print(loaded)
        assert "nvmeswap.aio" not in sys.modules and "nvmeswap.checkpoint" not in sys.modules
        from nvmeswap.aio import aio_handle
        from nvmeswap.checkpoint import save
        assert nvmeswap.aio_handle is aio_handle and nvmeswap.save is save
        assert set(nvmeswap.__all__) <= set(dir(nvmeswap))
        assert all(getattr(nvmeswap, name) is not None for name in nvmeswap.__all__)
        try:
            nvmeswap.no_such_name
        except AttributeError as error:
            print("refused:", error)
    """
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "['nvmeswap.errors']", "refused: module 'nvmeswap' has no attribute 'no_such_name'"]
