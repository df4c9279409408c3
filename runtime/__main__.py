"""`python -m convgrad`: the `convgrad` command."""

import sys

from convgrad.cli import main

sys.exit(main())
