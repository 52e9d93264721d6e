"""The model executor: model definitions, paged attention, compilation and the runner that
turns a scheduled batch into logits. Nothing here knows about Triton or requests' text."""

from tritone.executor.runner import ModelRunner, kv_bytes_per_token

__all__ = ["ModelRunner", "kv_bytes_per_token"]
