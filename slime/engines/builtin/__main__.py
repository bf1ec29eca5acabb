"""`python -m slime.engines.builtin --model PATH --port P` runs the built-in engine server."""

import sys

from slime.engines.builtin.server import main

sys.exit(main())
