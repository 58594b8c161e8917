"""The examples of README.md and docs/USAGE.md run as written (GPU): README's alone, each of USAGE's
from that page's setup block (its first)."""
import pathlib
import re

import pytest

from tests.conftest import gpu

ROOT = pathlib.Path(__file__).resolve().parent.parent


def blocks(page):
    return re.findall(r"```python\n(.*?)```", (ROOT / page).read_text(), flags=re.S)


def test_pages_have_examples():
    assert len(blocks("README.md")) == 1 and len(blocks("docs/USAGE.md")) >= 7


@gpu
def test_readme_example():
    scope = {}
    exec(blocks("README.md")[0], scope)
    assert scope["o"].shape == scope["v"].shape and scope["final_state"].shape == scope["h0"].shape


@gpu
@pytest.mark.parametrize("index", range(1, len(blocks("docs/USAGE.md"))))
def test_usage_example(index):
    setup, *examples = blocks("docs/USAGE.md")
    scope = {}
    exec(setup, scope)
    exec(examples[index - 1], scope)
    assert {"o", "o2", "plan"} & scope.keys()          # what each example computes
