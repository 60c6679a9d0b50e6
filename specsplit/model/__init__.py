"""Llama-family model code: config, our forward over the paged KV cache, loading."""
