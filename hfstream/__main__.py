"""``python -m hfstream`` is the ``hfstream`` command."""

import sys

from hfstream.cli.main import main

sys.exit(main())
