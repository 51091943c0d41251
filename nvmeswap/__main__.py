import sys

from .cli.main import command

sys.exit(command())
