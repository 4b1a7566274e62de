"""The ``swapopt`` command line: ``demo``, ``plan`` and ``plot``."""
