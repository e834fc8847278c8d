"""What the tests share, apart from the tests themselves: launching the real entry points (launch.py), the entry
scripts and workers those launches run (*_entry.py, *_check.py, *_run.py, transport_worker.py, ...), the tiny
models and runs several test files read, and plugins/ (modules loaded by MEGATRON_PLUGINS).

Imported as ``helpers``: pytest puts tests/ on the path for the tests, and launch.child_env does for every
process the tests start, so that an entry script run by its path imports its siblings the same way.
"""
