"""The project's benchmarks, one folder per subject (see ``benchmarks/README.md``). Run each from the repository
root as a module, e.g. ``.venv/bin/python -m benchmarks.ps.ps_bench``; they import each other and ``common/`` as
this package."""
