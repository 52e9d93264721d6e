"""The engine: the step loop (`core`: schedule, run and sample, update), and the threads that
drive the loop (`async_engine`). Nothing here knows about Triton."""
