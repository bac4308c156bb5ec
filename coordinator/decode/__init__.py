"""The decode core every front end drives: what each pass feeds, the checked passes, sampling (core.py,
passes.py, sampling.py), and the one-conversation clients (one.py)."""
