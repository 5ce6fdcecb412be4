"""kvtierd: a standalone KV-cache tiering daemon for LLM inference engines."""

__version__ = "0.1.0"
