"""``python -m offline_plugins.cli``: the same as the ``offline-plugins`` command."""

import sys

from offline_plugins.cli import main

sys.exit(main())
