"""``python -m producers.sandbox``: same as ``python -m producers.sandbox.worker``."""

import sys

from producers.sandbox.worker import main

sys.exit(main())
