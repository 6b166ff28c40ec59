"""``python -m consumers.analytics.dashboard``: the live dashboard (see ``server``)."""

import sys

from consumers.analytics.dashboard.server import main

sys.exit(main())
