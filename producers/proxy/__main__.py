"""``python -m producers.proxy``: same as ``python -m producers.proxy.app``."""

import sys

from producers.proxy.app import main

sys.exit(main())
