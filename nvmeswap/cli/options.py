"""What the three commands share: argument types whose messages speak in CLI words, the
up-front check of output paths, and the one-line errors the commands end with."""
import argparse
import os
import shutil
import signal
import sys
import threading

from ..units import human_size


class UsageError(Exception):
    """A refusal before any work: printed as one line, exit status 2."""


class Formatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the descriptions' line breaks and shows each option's default, unless its help
    already says it (a default of None means "decided later", which the help explains)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS) \
                or not action.option_strings:
            return text
        return text + " (default: %(default)s)"


def positive_int(text):
    return _int_at_least(text, 1)


def non_negative_int(text):
    return _int_at_least(text, 0)


def _int_at_least(text, low):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be {low} or more, got {value}")
    return value


def positive_float(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, got {text}")
    return value


def check_output_path(path, option):
    """Refuse, before the run, an output file that could not be written at its end."""
    if path is None or path == "-":
        return
    folder = os.path.dirname(os.path.abspath(path)) or "."
    if os.path.isdir(path):
        raise UsageError(f"{option} {path}: is a folder; give a file name")
    if not os.path.isdir(folder):
        raise UsageError(f"{option} {path}: folder {folder} does not exist; "
                         f"create it (mkdir -p {folder}) or pick another path")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise UsageError(f"{option} {path}: file is not writable; pick another path")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(f"{option} {path}: folder {folder} is not writable; "
                         "pick another path")


def check_folder(folder, option="--folder"):
    """The folder the files go to: it exists and this user may create files in it."""
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise UsageError(f"{option} {folder}: is not a folder; give a folder on the SSD")
    if not os.path.isdir(folder):
        raise UsageError(f"{option} {folder}: does not exist; create it (mkdir -p {folder}) "
                         "or pick another folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(f"{option} {folder}: not writable by this user; "
                         f"chmod u+w {folder} or pick another folder")


def write_json(path, data, command) -> bool:
    """``data`` as indented JSON to ``path`` ('-' or None: standard output). False, said
    in one line, where it cannot be written (a full disk): the caller still prints its
    results, then exits 1. A closed standard output is main's to handle."""
    import json
    text = json.dumps(data, indent=2) + "\n"
    try:
        if path is None or path == "-":
            sys.stdout.write(text)
            sys.stdout.flush()
        else:
            with open(path, "w") as f:
                f.write(text)
    except BrokenPipeError:
        raise
    except OSError as error:
        print(f"nvmeswap {command}: --json {path}: {error.strerror or error}",
              file=sys.stderr)
        return False
    return True


def torch_available():
    """Whether torch can be imported, found without importing it (that takes seconds)."""
    import importlib.util
    if "torch" in sys.modules:
        return sys.modules["torch"] is not None
    try:
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):
        return False


def gpu_count():
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


# Python names in messages from the library, as the options that set them are spelt.
_CLI_WORDS = {"block_size": "--block-size", "queue_depth": "--queue-depth",
              "intra_op_parallelism": "--intra-op-parallelism",
              "single_submit": "--single-submit", "overlap_events": "--overlap-events"}


def in_cli_words(message):
    for name, option in _CLI_WORDS.items():
        message = message.replace(name, option)
    return message


class StopOnInterrupt:
    """While active, the first Ctrl-C sets ``event`` (the command stops at its next safe point
    and keeps what it measured) and the second interrupts at once."""

    def __init__(self, event=None):
        self.event = event if event is not None else threading.Event()
        self.interrupted = False
        self._previous = None

    def _handler(self, signum, frame):
        self.interrupted = True
        self.event.set()
        signal.signal(signal.SIGINT, self._previous)

    def __enter__(self):
        # A process started with SIGINT ignored (`nvmeswap bench &` in a script) keeps it so.
        if threading.current_thread() is threading.main_thread() \
                and signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
            self._previous = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc_info):
        if self._previous is not None and signal.getsignal(signal.SIGINT) == self._handler:
            signal.signal(signal.SIGINT, self._previous)


def check_room(folder, disk_bytes, memory_bytes, lower):
    """The folder's free space and the free memory, checked before any work (a size too
    large for memory was an OOM kill, with no word); ``lower`` says what to change."""
    from .bench import available_memory  # bench imports this module
    free = shutil.disk_usage(folder).free
    if disk_bytes > free:
        raise UsageError(f"--folder {folder} has {human_size(free)} free; the run needs "
                         f"{human_size(disk_bytes)}: {lower} or free some space")
    available = available_memory()
    if memory_bytes > available:
        raise UsageError(f"the run needs {human_size(memory_bytes)} of memory and "
                         f"{human_size(max(available, 0))} is available: {lower}")


def load_torch_uninterrupted():
    """Import torch (where installed) with SIGINT held: a Ctrl-C that lands in torch's own
    import can abort the process (a C++ exception thrown where none may pass); held, it
    lands once torch is loaded, as a KeyboardInterrupt. (Not for bench and tune: their
    own handler, which only asks them to stop after what they measure, is in place
    before they load torch.)"""
    if "torch" in sys.modules or threading.current_thread() is not threading.main_thread():
        return
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        import torch  # noqa: F401
    except ImportError:
        pass
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
