"""The engine core's scheduling state: requests, KV block pool, prefix cache and the scheduler.

Pure Python: nothing here imports torch (tests/core/test_imports.py checks it).
"""
