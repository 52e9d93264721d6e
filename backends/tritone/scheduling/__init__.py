"""What the engine schedules and the executor reads: requests and their sampling parameters,
guides for structured outputs, the KV cache's blocks with prefix caching, and the scheduler that
picks each step's tokens. Nothing here runs the model."""
