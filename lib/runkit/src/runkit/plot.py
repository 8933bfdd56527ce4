"""``python -m runkit.plot RUN [RUN ...]``: redraw ``curves.png`` (see :mod:`runkit.plots`)."""

from runkit.plots import main

if __name__ == "__main__":
    raise SystemExit(main())
