"""``python -m producers.scheduler``: same as ``python -m producers.scheduler.service``."""

import sys

from producers.scheduler.service import main

sys.exit(main())
