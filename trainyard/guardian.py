"""`python -m trainyard.guardian PID STATE_FILE SPARE_FILE...`, the name and arguments
earlier releases started the guardian's watcher by; it is trainyard.cli.guardian. Kept for
one release."""

import sys
from pathlib import Path

from trainyard.cli.guardian import watch

if __name__ == "__main__":
    sys.exit(watch(int(sys.argv[1]), Path(sys.argv[2]), [Path(p) for p in sys.argv[3:]]))
