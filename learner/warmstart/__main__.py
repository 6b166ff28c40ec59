"""``python -m learner.warmstart``: same as ``python -m learner.warmstart.sft``."""

import sys

from learner.warmstart.sft import main

sys.exit(main())
