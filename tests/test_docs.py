"""The examples of README.md and docs/USAGE.md run as written (GPU): README's each alone, each of
USAGE's that runs in one process from that page's setup block (its first)."""
import pathlib
import re

import pytest

from tests.conftest import gpu

ROOT = pathlib.Path(__file__).resolve().parent.parent


def blocks(page):
    return re.findall(r"```python\n(.*?)```", (ROOT / page).read_text(), flags=re.S)


def in_process(page):
    """The examples of a page that run in this process: not those written for torchrun (first line
    `# torchrun ...`), which examples/context_parallel.py stands for (tests/test_distributed.py)."""
    return [b for b in blocks(page) if not b.startswith("# torchrun")]


def test_pages_have_examples():
    assert len(blocks("README.md")) == 2 and len(blocks("docs/USAGE.md")) >= 9


@gpu
def test_readme_example():
    scope = {}
    exec(blocks("README.md")[0], scope)
    assert scope["o"].shape == scope["v"].shape and scope["final_state"].shape == scope["h0"].shape


@gpu
def test_readme_serving_example():
    """The pool example: the rows of the requests with a state change, the others stay zero."""
    scope = {}
    exec(blocks("README.md")[1], scope)
    pool = scope["pool"]
    assert scope["o"].shape == scope["v"].shape and pool[[5, 9, 2]].abs().sum(dim=(1, 2, 3)).min() > 0
    assert pool[[r for r in range(64) if r not in (5, 9, 2)]].abs().max() == 0


@gpu
@pytest.mark.parametrize("index", range(1, len(in_process("docs/USAGE.md"))))
def test_usage_example(index):
    setup, *examples = in_process("docs/USAGE.md")
    scope = {}
    exec(setup, scope)
    exec(examples[index - 1], scope)
    assert {"o", "o2", "plan"} & scope.keys()          # what each example computes
