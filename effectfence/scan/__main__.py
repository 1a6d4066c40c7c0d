"""``python -m effectfence.scan PATH``."""

import sys

from .cli import main

sys.exit(main())
