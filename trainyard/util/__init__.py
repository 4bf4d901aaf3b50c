"""Small tools every layer may use: whole-file writes, hashes, locks, caches, logging, detached servers."""
