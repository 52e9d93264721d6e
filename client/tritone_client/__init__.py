"""A small client for Tritone's `ensemble` on tritonclient: generate and chat, gRPC and HTTP."""

from tritone_client.client import Chunk, TritoneClient

__all__ = ["Chunk", "TritoneClient"]
