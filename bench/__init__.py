"""fleetrl benchmarks: each module runs with `python -m bench.<name> --json` and prints one JSON object."""
