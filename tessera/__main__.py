"""``python -m tessera``."""

import sys

from tessera.cli.main import main

sys.exit(main())
