"""Every ```python block of README.md and docs/*.md runs as written, so that none drifts from the code.

The blocks of one page run in order in one fresh interpreter, as a user pastes them into one
session, in a folder that holds what the pages assume: the checkpoint of
``lightning-twod fit --config examples/configs/synthetic_2x2.yaml`` (shortened to two steps on one
process) at ``checkpoints/synthetic_2x2/last.ckpt``. A block may be kept out with the line
``<!-- not run: WHY -->`` right before its fence (a cluster, a GPU, a fragment); those must be few,
and each says why.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NOT_RUN = re.compile(r"^<!-- not run: (.+) -->$")
MOST_NOT_RUN = 4  # blocks kept out, over every page
#: Runs every block of a page in one namespace; each block compiled under "page:line" for tracebacks.
RUNNER = """
import json, sys
namespace = {"__name__": "__main__"}
for where, code in json.loads(sys.argv[1]):
    exec(compile(code, where, "exec"), namespace)
"""


@dataclass
class Block:
    page: str
    line: int  # of the fence
    code: str
    not_run: str | None  # why, where marked


def blocks(path: Path) -> list[Block]:
    """The ```python blocks of ``path`` (fences at the start of a line)."""
    lines, found, index = path.read_text().splitlines(), [], 0
    while index < len(lines):
        if lines[index].strip() == "```python":
            end = next(i for i in range(index + 1, len(lines)) if lines[i].strip() == "```")
            before = next((lines[i].strip() for i in range(index - 1, -1, -1) if lines[i].strip()), "")
            marked = NOT_RUN.match(before)
            found.append(Block(str(path.relative_to(ROOT)), index + 1, "\n".join(lines[index + 1:end]) + "\n",
                               marked.group(1) if marked else None))
            index = end
        index += 1
    return found


ALL = [block for page in PAGES for block in blocks(page)]


def test_few_blocks_are_kept_out_and_each_says_why():
    kept_out = [b for b in ALL if b.not_run]
    assert len(ALL) - len(kept_out) >= 3, "the pages' runnable blocks were not found"
    assert len(kept_out) <= MOST_NOT_RUN, [f"{b.page}:{b.line}: {b.not_run}" for b in kept_out]
    for block in kept_out:
        assert len(block.not_run.split()) >= 3, f"{block.page}:{block.line}: say why it is not run"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A folder with the synthetic example's checkpoint, as the pages assume after its ``fit``."""
    folder = tmp_path_factory.mktemp("docs")
    done = subprocess.run([sys.executable, "-m", "lightning_twod", "fit",
                           "--config", str(ROOT / "examples" / "configs" / "synthetic_2x2.yaml"),
                           "--trainer.devices", "1", "--trainer.strategy.init_args.shard_group_size", "1",
                           "--trainer.max_steps", "2", "--trainer.val_check_interval", "2",
                           "--trainer.limit_val_batches", "1", "--trainer.logger", "false"],
                          capture_output=True, text=True, timeout=300, cwd=folder)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (folder / "checkpoints" / "synthetic_2x2" / "last.ckpt").is_dir()
    return folder


@pytest.mark.parametrize("page", sorted({b.page for b in ALL if not b.not_run}))
def test_the_blocks_of_a_page_run_as_written(page, workdir):
    run = [(f"{b.page}:{b.line}", b.code) for b in ALL if b.page == page and not b.not_run]
    done = subprocess.run([sys.executable, "-c", RUNNER, json.dumps(run)], capture_output=True, text=True,
                          timeout=300, cwd=workdir)
    assert done.returncode == 0, done.stderr[-3000:]
