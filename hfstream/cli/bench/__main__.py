"""``python -m hfstream.cli.bench``: the gradient-communication benchmark (`hfstream bench`)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
