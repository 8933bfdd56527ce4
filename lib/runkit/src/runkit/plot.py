"""``python -m runkit.plot RUN [RUN ...]``: redraw ``curves.png`` of runs or sweeps (entry point).

The drawing lives in :mod:`runkit.plots`; this module only names the command.
"""

import sys

from runkit.plots import main

if __name__ == "__main__":
    sys.exit(main())
