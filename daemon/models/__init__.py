"""Model files: the store, GGUF import, model descriptions, and parts shared with peers."""
