"""A small client for Tritone's `ensemble` on tritonclient: generate and chat, gRPC and HTTP."""

from tritone_client.client import Chunk, TritoneClient, infer_inputs

__all__ = ["Chunk", "TritoneClient", "infer_inputs"]
