"""`python -m trainyard.guardian`, the name earlier releases started the guardian by; it is
trainyard.runtime.guardian. Kept for one release."""

import sys
from pathlib import Path

from trainyard.runtime.guardian import watch

if __name__ == "__main__":
    sys.exit(watch(int(sys.argv[1]), Path(sys.argv[2]), [Path(p) for p in sys.argv[3:]]))
