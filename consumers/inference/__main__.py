"""``python -m consumers.inference``: same as ``python -m consumers.inference.server``."""

import sys

from consumers.inference.server import main

sys.exit(main())
