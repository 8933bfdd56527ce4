"""``python -m runkit.devices``: the GPUs this process may use, as ``cuda:N`` (the command's name)."""

from runkit.gpus.listing import main

if __name__ == "__main__":
    raise SystemExit(main())
