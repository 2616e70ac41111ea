"""``python -m dev.gpu_check``: see the package's docstring."""

import sys

from dev.gpu_check.runner import main

if __name__ == "__main__":
    sys.exit(main())
