"""``python -m runkit.devices``: list the GPUs this process may use, as ``cuda:N`` (entry point).

The listing lives in :mod:`runkit.gpus.listing`; this module only names the command.
"""

import sys

from runkit.gpus.listing import main

if __name__ == "__main__":
    sys.exit(main())
