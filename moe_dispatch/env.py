"""``python -m moe_dispatch.env [--json]``: the installation report of :mod:`moe_dispatch.tools.env`."""

import sys

from .tools.env import collect, main, print_report

__all__ = ["collect", "main", "print_report"]

if __name__ == "__main__":
    sys.exit(main())
