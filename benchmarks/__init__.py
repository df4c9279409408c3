"""convgrad's benchmarks, a package run from the repository's root folder:

    python -m benchmarks.bench ...        # each module's docstring gives its command

The command-line tools (bench, train_step, jax_ops, pair_plans, ab_builds, ...) share their
code through its modules (shapes, cases, timing, machine, reports, xla, ...); none of it
is part of the installed convgrad package. tests/test_bench*.py import it through
pyproject.toml's pytest `pythonpath`.
"""
