"""`python -m gateway.bench ...`: the bench without the gateway CLI."""

import sys

from gateway.bench.cli import main

sys.exit(main())
