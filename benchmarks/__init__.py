"""evalkit's benchmarks: one module per benchmark, each run from the repository root as
``.venv/bin/python -m benchmarks.<name>``; what each measures, how long it takes and which page quotes it:
benchmarks/README.md. The runners they share are in benchmarks/common/."""
