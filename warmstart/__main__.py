"""``python -m warmstart``: same as ``python -m warmstart.sft``."""

import sys

from warmstart.sft import main

sys.exit(main())
