"""``python -m kvship.app`` is the ``kvship`` console script."""

import sys

from kvship.app.cli import main

sys.exit(main())
