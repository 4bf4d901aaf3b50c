"""`python -m trainyard.worker`, as scripts written for earlier releases start it; the worker
is trainyard.engine.worker. Kept for one release."""

from trainyard.engine.worker import main

if __name__ == "__main__":
    main()
