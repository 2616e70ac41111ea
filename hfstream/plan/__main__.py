"""``python -m hfstream.plan``: the same planner as ``hfstream plan``."""

import sys

from .cli import main

sys.exit(main())
