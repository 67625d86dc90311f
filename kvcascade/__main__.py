"""``python -m kvcascade`` runs the same command as ``kvcascade``."""

import sys

from kvcascade.cli import main

sys.exit(main())
