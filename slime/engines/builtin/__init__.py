"""The built-in inference engine: an HTTP server on `transformers` that speaks SGLang's protocol.

It stands in for SGLang where SGLang cannot run (CPU machines, CI) and as a fallback on GPUs; the
rollout code talks to it through the same router and endpoints as to SGLang.
"""
