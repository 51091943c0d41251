"""The ``nvmeswap`` command: bench (ds_io), tune (ds_nvme_tune), report (ds_report)."""
import argparse
import os
import sys

from .. import __version__
from . import bench, report, tune
from .options import Formatter, UsageError

DESCRIPTION = """\
Move tensors between memory and files on fast SSDs.

  nvmeswap bench   throughput test (DeepSpeed's ds_io)
  nvmeswap tune    best handle settings for a folder (ds_nvme_tune)
  nvmeswap report  can nvmeswap work here, and versions (ds_report)

Sizes: K, M, G are powers of 1024 (as in ds_io). Speeds: GB/s with GB = 10^9 bytes,
except the Task/E2E lines, which keep ds_io's GB = 2^30 bytes."""


def build_parser():
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
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return args.run(args)
    except UsageError as error:
        print(f"nvmeswap {args.command_name}: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"nvmeswap {args.command_name}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`nvmeswap bench | head`): say nothing more, as cat does.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
