"""The KV cache: its types (one table) and the per-conversation cache of per-layer storages."""
