"""pytest-benchmark suites (a package, so its conftest does not shadow tests/conftest.py)."""
