"""The ``nvmeswap`` command: bench (ds_io), tune (ds_nvme_tune), report (ds_report)."""
import argparse
import os
import signal
import sys

from .. import __version__
from .options import Formatter, UsageError

DESCRIPTION = """\
Move tensors between memory and files on fast SSDs.

  nvmeswap bench   throughput test (DeepSpeed's ds_io)
  nvmeswap tune    best handle settings for a folder (ds_nvme_tune)
  nvmeswap report  can nvmeswap work here, and versions (ds_report)

Sizes: K, M, G are powers of 1024 (as in ds_io). Speeds: GB/s with GB = 10^9 bytes,
except the Task/E2E lines, which keep ds_io's GB = 2^30 bytes."""


def build_parser():
    from . import bench, report, tune  # here: a Ctrl-C while they load is main()'s to answer

    parser = argparse.ArgumentParser(prog="nvmeswap", description=DESCRIPTION,
                                     formatter_class=Formatter)
    parser.add_argument("--version", action="version", version=f"nvmeswap {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module, summary in (("bench", bench, "throughput test (like ds_io)"),
                                  ("tune", tune, ("best settings for a folder "
                                                  "(like ds_nvme_tune)")),
                                  ("report", report, "can nvmeswap work here? (like ds_report)")):
        sub = commands.add_parser(name, help=summary, description=module.__doc__.replace("``", ""),
                                  formatter_class=Formatter)
        module.add_arguments(sub)
        sub.set_defaults(run=module.run, command_name=name)
    return parser


def main(argv=None):
    command = "nvmeswap"
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help()
            return 0
        command = f"nvmeswap {args.command_name}"
        return args.run(args)
    except UsageError as error:
        print(f"{command}: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`nvmeswap bench | head`): say nothing more, as cat does.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


def command():
    """The ``nvmeswap`` command: ``main`` on the process's arguments, exit 130 on Ctrl-C.

    Python drops an interrupt that lands in a callback it cannot raise from (a weakref's,
    a finalizer's: "Exception ignored"), and the command would go on as if none came: so
    each one is counted here as well. Once the command has answered, a Ctrl-C is ignored:
    the interpreter would end itself by SIGINT on one it did not catch while shutting
    down, and the exit status would no longer say how the command ended."""
    interrupts = []

    def count_and_interrupt(signum, frame):
        interrupts.append(signum)
        raise KeyboardInterrupt

    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, count_and_interrupt)
    code = main()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if interrupts and code != 130:
        print("nvmeswap: interrupted", file=sys.stderr)
        return 130
    return code


if __name__ == "__main__":
    sys.exit(command())
