"""``python -m headway ...`` is the ``headway`` command (also what ``accelerate launch -m headway`` runs)."""

import sys

from headway.cli import main

sys.exit(main())
