"""``python -m learner``: same as ``python -m learner.train``."""

import sys

from learner.train import main

sys.exit(main())
