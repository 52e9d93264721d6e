"""The Triton glue, without importing Triton: what the model adapters in model_repository/ call.
Triton's utilities module comes in as an argument wherever it is needed."""
