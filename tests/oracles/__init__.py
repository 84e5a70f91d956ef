"""Reference implementations the tests compare the package against (not part of the package)."""
