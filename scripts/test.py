"""Correctness and benchmark CLI for kda_opt on a GPU machine; `--help` lists the options.

    python scripts/test.py --test {naive,fla,benchmark,all} [--sweep] ...
The CLI lives in scripts/kda_bench/bench.py, its modes beside it; kda_opt must be importable (installed,
as scripts/check.sh does).
"""
import sys

from kda_bench.bench import main

if __name__ == "__main__":
    sys.exit(main())
