"""``python -m project.devices``: list the GPUs this process may use, as ``cuda:N`` (entry point).

The listing lives in :mod:`project.machinery.gpus.listing`; this module only names the command.
"""

import sys

from project.machinery.gpus.listing import main

if __name__ == "__main__":
    sys.exit(main())
