"""``python -m conformance [--quick] [--device cpu|cuda] [--json PATH] [--ops a,b]``: see conformance.runner."""
import sys

from .runner import main

if __name__ == "__main__":
    sys.exit(main())
