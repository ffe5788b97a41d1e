"""Long test campaigns run by hand, beside the test suite: RPC fuzzing (``fuzz_ps.py``), a load soak
(``ps_soak.py``), fault scenarios of whole training runs (``fault_scenarios.py``), and the depth of the calls from
the servicer to each of the store's native kernels (``kernel_depths.py``). Run each from the repository
root as a module, e.g. ``.venv/bin/python -m tools.fuzz_ps``; their fast subsets are in ``tests/``."""
