"""The ``nvmeswap`` command: bench (ds_io), tune (ds_nvme_tune), report (ds_report)."""
import argparse
import sys

from . import bench, report, tune


def main(argv=None):
    parser = argparse.ArgumentParser(prog="nvmeswap", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    bench.add_arguments(commands.add_parser("bench", help="throughput test (like ds_io)"))
    tune.add_arguments(commands.add_parser("tune", help="best settings for a folder "
                                                        "(like ds_nvme_tune)"))
    report.add_arguments(commands.add_parser("report", help="can nvmeswap work here?"))
    args = parser.parse_args(argv)
    return {"bench": bench.run, "tune": tune.run, "report": report.run}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
