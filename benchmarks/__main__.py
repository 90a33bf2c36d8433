"""``python -m benchmarks NAME [run|render] [options]``: see :mod:`benchmarks._instrument`."""
import sys

from benchmarks._instrument import main

sys.exit(main())
