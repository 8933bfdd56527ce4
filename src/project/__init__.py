"""A PyTorch Lightning + Hydra project template.

Modules are imported lazily so that ``python -m project.train --help`` stays fast: importing
``project`` itself pulls in neither torch nor Lightning.
"""

__version__ = "0.1.0"
