"""``python -m producers.tasks``: same as ``python -m producers.tasks.catalog``."""

import sys

from producers.tasks.catalog import main

sys.exit(main())
