"""`python -m slime.rl --config FILE [--flag value ...]`: the same as `slime rl`."""

import sys

from slime.cli import main

if __name__ == "__main__":
    sys.exit(main(["rl", *sys.argv[1:]]))
