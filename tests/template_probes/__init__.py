"""Modules a rank template preloads in `test_pool.py`: one warms up, one leaves a thread running."""
