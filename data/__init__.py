"""Streaming over sharded parquet: config -> shards -> stream -> loader, with preview and the demo corpus."""
