"""spark-guard's test suite: `pytest` from the checkout's root.

The machines the tests drive (user managers, containers, the VM, synthetic GGUFs)
live in lab/, shared with demo/ and benchmarks/; here are the tests and the helpers
only they use.
"""
