"""Correctness and benchmark CLI for kda_opt (GPU machine): `python scripts/test.py --test benchmark`."""
import sys

if __name__ == "__main__":
    print("scripts/test.py: not yet — the correctness/benchmark CLI is still being built", file=sys.stderr)
    sys.exit(2)
