"""`python -m slime ...` is the `slime` command."""

import sys

from slime.cli import main

sys.exit(main())
