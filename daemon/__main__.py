"""`python -m meshd ...` is the `meshd` command."""

import sys

from meshd.api.cli import main

sys.exit(main())
