"""Models: the registry of factories (`model.name`) and the built-in zoo."""
