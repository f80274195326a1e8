"""`python -m bench ...`: the bench without the gateway CLI."""

import sys

from bench.cli import main

sys.exit(main())
