"""The serving loop: `Engine` (`engine.py`) and its requests (`request.py`), the step plan
(`scheduler.py`), one forward per step (`runner.py`), how a request ends (`outcomes.py`),
the synchronous paths on the loop thread (`sync_paths.py`, `threads.py`), prompt encoding
(`prompt.py`) and the per-request fallback (`sequential.py`)."""
