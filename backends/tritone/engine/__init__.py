"""The engine: the step loop (`core`: schedule, run the model, sample, update), the sampler, and
the threads that drive the loop (`async_engine`). Nothing here knows about Triton."""
