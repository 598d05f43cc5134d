"""``python -m fxoffload explain ...``: the command line (``fxoffload.tools.cli``)."""

import sys

from .tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
