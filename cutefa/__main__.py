"""``python -m cutefa`` runs the ``cutefa`` command line."""

import sys

from cutefa.cli import main

sys.exit(main())
