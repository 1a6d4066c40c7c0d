"""``python -m effectfence``: the same as the ``effectfence`` command."""

import sys

from effectfence.cli import main

sys.exit(main())
