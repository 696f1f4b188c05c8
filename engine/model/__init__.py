"""The model side of the engine: loading a model and its tokenizer (`loading.py`, what a
directory must hold: `files.py`), the built-in `smollm2` and GGUF files (`gguf.py`), the
pinned `tiny` model (`tiny.py`), tokenizers without torch (`tokenizer.py`, what the router
loads), the weights' fingerprint (`fingerprint.py`) and packed linear layers (`linear.py`).

This face imports nothing, so that `engine.model.tokenizer` loads no torch."""
