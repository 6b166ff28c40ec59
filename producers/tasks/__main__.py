"""``python -m producers.tasks``: ``list SPEC`` (a suite's tasks) and ``show TASK`` (one task); see ``--help``."""

import sys

from producers.tasks.describe import main

sys.exit(main())
