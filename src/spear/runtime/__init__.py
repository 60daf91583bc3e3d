"""The serving runtime: a compact Llama-family model, a paged KV cache and the engine."""
