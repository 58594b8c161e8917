"""Correctness and benchmark CLI for kda_opt on a GPU machine; `--help` lists the options.

    python scripts/test.py --test {naive,fla,benchmark,all} [--sweep] ...
The logic lives in kda_opt/bench.py (also `python -m kda_opt.bench`).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from kda_opt.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
