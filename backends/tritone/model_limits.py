"""A checkpoint's limits that every process reads the same way (the engine's runner and the
preprocessing model both refuse what the model cannot hold)."""

from __future__ import annotations


def context_length(hf_config, max_model_len: int = 0) -> int:
    """The tokens a sequence may hold: `max_model_len` where set, else the model's own limit
    (its text config's max_position_embeddings; 0 where it names none)."""
    if max_model_len:
        return max_model_len
    return int(getattr(hf_config.get_text_config(), "max_position_embeddings", 0) or 0)
