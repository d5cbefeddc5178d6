"""`python -m megatrain ...`: the same as the `megatrain` command."""

import sys

from megatrain.cli import main

sys.exit(main())
