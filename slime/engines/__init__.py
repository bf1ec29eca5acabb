"""Inference engines: SGLang and built-in server launch, sglang-router management, the async HTTP client."""
