"""``python -m project.plot RUN [RUN ...]``: redraw ``curves.png`` of runs or sweeps (entry point).

The drawing lives in :mod:`project.machinery.plots`; this module only names the command.
"""

import sys

from project.machinery.plots import main

if __name__ == "__main__":
    sys.exit(main())
