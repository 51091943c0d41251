"""The sources keep their own rules, as uvloop's tests/test_sourcecode.py checks its own:
every design note referred to is defined exactly once, the README's note index names
each defined note with its file, ``ruff check`` is clean, and commit subjects read
"area: summary".

Design notes are ``Note [...]`` (PyTorch's convention). Where one is defined, read
``definition_of`` below; everywhere else its name is a reference.
"""
import bisect
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTE_PLACES = ["nvmeswap", "pyx", "cdeps", "bench", "tests", "examples", "docs", "README.md"]
NOTE_SUFFIXES = {".py", ".pyi", ".pyx", ".pxd", ".h", ".md"}
FIRST_CHECKED_COMMIT = "b16101e"    # the commit subjects before it predate the rule

NOTE = re.compile(r"Note \[([^\[\]]+)\]")
# What may open a line before its text: indentation and one comment marker or the
# quotes that open a docstring.
LINE_OPENING = re.compile(r'^\s*(?:#|//|/\*|\*(?!/)|[rRbBuU]?"""|[rRbBuU]?\'\'\')?\s?')
DEFINITION = re.compile(r"Note \[([^\[\]]+)\](?::|\s*$)")


def note_files():
    """Every file that may name a note; this one speaks about notes and names none."""
    for place in NOTE_PLACES:
        path = ROOT / place
        for file in sorted([path] if path.is_file() else path.rglob("*")):
            if (file.suffix in NOTE_SUFFIXES and file.is_file() and "build" not in file.parts
                    and file != Path(__file__).resolve()):
                yield file


def name_of(text):
    return " ".join(text.split())


def definition_of(lines, index, in_tests):
    """The note that line ``index`` defines, or None.

    A note is defined by the line that opens a paragraph with its name: after the
    indentation and one comment marker (``#``, ``//``, ``/*``, ``*``) or the quotes that
    open a docstring, the line is the name alone (``Note [...]``, its text on the lines
    below) or the name and a colon (``Note [...]: its text``); and the line opens a
    paragraph: it opens its docstring, it is the first line of its comment block, or
    the line above is blank (or a bare comment marker). In tests/ no line defines a
    note: a test's docstring that opens with a note's name says which note the test
    checks.
    """
    if in_tests:
        return None
    line = lines[index]
    opening = LINE_OPENING.match(line).group(0)
    found = DEFINITION.match(line[len(opening):])
    if not found:
        return None
    opens_docstring = '"""' in opening or "'''" in opening
    is_comment = opening.strip() in ("#", "//", "/*", "*")
    above = lines[index - 1] if index else ""
    above_rest = above[len(LINE_OPENING.match(above).group(0)):].strip()
    above_is_comment = LINE_OPENING.match(above).group(0).strip() in ("#", "//", "/*", "*")
    opens_paragraph = (opens_docstring or not above_rest
                       or (is_comment and not above_is_comment))
    return name_of(found.group(1)) if opens_paragraph else None


def scan_notes():
    """``(references, definitions)``: note name -> ["path:line", ...]."""
    references, definitions = {}, {}
    for file in note_files():
        relative = str(file.relative_to(ROOT))
        lines = file.read_text(errors="replace").splitlines()
        in_tests = relative.startswith("tests/")
        # Join the lines, each without its indentation and comment marker, so that a
        # name wrapped over two lines (``Note [caller`` / ``# queue]``) reads whole.
        starts, pieces, offset = [], [], 0
        for index, line in enumerate(lines):
            piece = line[len(LINE_OPENING.match(line).group(0)):]
            starts.append(offset)
            pieces.append(piece)
            offset += len(piece) + 1
            name = definition_of(lines, index, in_tests)
            if name:
                definitions.setdefault(name, []).append(f"{relative}:{index + 1}")
        for found in NOTE.finditer(" ".join(pieces)):
            name = name_of(found.group(1))
            if name != "...":       # the placeholder of prose about notes
                line = bisect.bisect_right(starts, found.start())
                references.setdefault(name, []).append(f"{relative}:{line}")
    return references, definitions


def readme_note_index():
    """The README's closing paragraph, "Design notes are ...: [a] and [b] in file; ...",
    as note name -> the file it names (relative to the repository)."""
    text = (ROOT / "README.md").read_text()
    found = re.search(r"^Design notes are comments named `Note \[\.\.\.\]`.*?:(.*?)(?:\n\n|\Z)",
                      text, re.MULTILINE | re.DOTALL)
    assert found, "README.md has no paragraph 'Design notes are comments named `Note [...]`'"
    index = {}
    for entry in " ".join(found.group(1).split()).rstrip(".").split(";"):
        names, _, place = entry.strip().rpartition(" in ")
        place = place.strip("`")    # `__init__.py`: underscores that markdown would eat
        path = place if (ROOT / place).exists() else f"nvmeswap/{place}"
        for name in re.findall(r"\[([^\[\]]+)\]", names):
            index[name_of(name)] = path
    return index


def test_every_note_referred_to_is_defined_exactly_once():
    references, definitions = scan_notes()
    problems = []
    for name, places in sorted(references.items()):
        if name not in definitions:
            problems.append(f"Note [{name}] is referred to but never defined "
                            f"(referred to at {', '.join(places)})")
    for name, places in sorted(definitions.items()):
        if len(places) > 1:
            problems.append(f"Note [{name}] is defined {len(places)} times: "
                            f"{', '.join(places)}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("lines,index,in_tests,defined", [
    (["", "Note [a b]"], 1, False, "a b"),                        # a title line
    (["    x = 1", "    # Note [a]: why"], 1, False, "a"),          # opens a comment block
    (['    """Note [a]: why'], 0, False, "a"),                      # opens a docstring
    (["Text.", "", "    Note [a]: why"], 2, False, "a"),           # opens a paragraph
    (["/* the", " * Note [a]: why"], 1, False, None),              # inside a comment block
    (["(see", "Note [a]); more"], 1, False, None),                  # a wrapped reference
    (['"""Note [a] (io/x.py): do'], 0, False, None),                # names it, then says more
    (['"""Note [a], for x: do'], 0, False, None),
    (['"""Note [a]: what this test checks'], 0, True, None),       # tests refer only
])
def test_the_definition_rule(lines, index, in_tests, defined):
    assert definition_of(lines, index, in_tests) == defined


def test_the_readme_note_index_names_each_defined_note_with_its_file():
    _, definitions = scan_notes()
    defined = {name: sorted({place.split(":")[0] for place in places})
               for name, places in definitions.items()}
    index = readme_note_index()
    problems = [f"Note [{name}] is defined in {', '.join(files)} but not in the README's index"
                for name, files in sorted(defined.items()) if name not in index]
    problems += [f"the README's index lists Note [{name}] ({path}), which is not defined"
                 for name, path in sorted(index.items()) if name not in defined]
    problems += [f"the README's index puts Note [{name}] in {path}; it is defined in "
                 f"{', '.join(defined[name])}"
                 for name, path in sorted(index.items())
                 if name in defined and path not in defined[name]]
    assert not problems, "\n".join(problems)


def test_ruff_check_is_clean():
    if importlib.util.find_spec("ruff") is None:
        pytest.skip("ruff is not installed (pip install -e '.[test]')")
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "concise",
                           "--no-cache", "."], cwd=ROOT, capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def git(*args):
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True,
                          check=False)


def test_commit_subjects_read_area_colon_summary():
    """"area: summary" in at most 72 characters (liburing's log), for every commit after
    FIRST_CHECKED_COMMIT; merge commits are left alone."""
    top = git("rev-parse", "--show-toplevel")
    if top.returncode or Path(top.stdout.strip()).resolve() != ROOT:
        pytest.skip("not a git checkout of the project (an sdist, say)")
    if git("cat-file", "-e", f"{FIRST_CHECKED_COMMIT}^{{commit}}").returncode:
        pytest.skip(f"commit {FIRST_CHECKED_COMMIT} is not in this clone (a shallow one?)")
    log = git("log", "--no-merges", "--format=%h %s", f"{FIRST_CHECKED_COMMIT}..HEAD")
    assert log.returncode == 0, log.stderr
    bad = [line for line in log.stdout.splitlines()
           if not re.fullmatch(r"[\w./-]+(?:, [\w./-]+)*: \S.*", line.split(" ", 1)[1])
           or len(line.split(" ", 1)[1]) > 72]
    assert not bad, "commit subjects that are not 'area: summary' in 72 characters:\n" + \
        "\n".join(bad)
