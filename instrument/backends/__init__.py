"""One module per destination; each imports its SDK lazily."""
