"""tritone-openai: an OpenAI-compatible HTTP front end to the ensemble (a process of its own;
never imports Triton's Python backend). `python -m tritone.openai --help`."""
