"""``python -m consumers.tracker``: the MLflow tracker (``clawstream track``; consumers/tracker/consumer.py)."""

import sys

from consumers.tracker.consumer import main

sys.exit(main())
