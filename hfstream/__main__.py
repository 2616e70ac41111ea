"""``python -m hfstream`` is the ``hfstream`` command."""

import sys

from hfstream.tools.cli import main

sys.exit(main())
