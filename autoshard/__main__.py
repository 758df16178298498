"""`python -m autoshard` runs the `autoshard` command."""

import sys

from autoshard.cli import main

sys.exit(main())
