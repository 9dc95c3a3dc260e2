"""`python -m blockscale ...`: the same as the `blockscale` command."""

import sys

from blockscale.cli import main

sys.exit(main())
