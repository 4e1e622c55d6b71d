"""examples/quickstart.ipynb runs top to bottom in a real Jupyter kernel (nbclient + ipykernel):
one process, then 4 forked processes ("twod_sparse_notebook" with the group size chosen
automatically, then a 2x2 mesh); it shows the sharding plans, the bytes per link class, a plot of
validation AUC per epoch, and metrics that beat the popularity baseline. The stored notebook keeps
its outputs (it reads on the web); the test executes a copy."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import nbclient  # requirements/cpu.txt pins nbclient, nbformat and ipykernel (the kernel)
import nbformat

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "examples" / "quickstart.ipynb"


def _text(cell) -> str:
    parts = []
    for output in cell.get("outputs", []):
        if output.get("output_type") == "stream":
            parts.append(output["text"])
        elif "data" in output:
            parts.append(output["data"].get("text/plain", ""))
        elif output.get("output_type") == "error":
            parts.append("\n".join(output.get("traceback", [])))
    return "".join(parts)


def test_quickstart_notebook_executes_and_reports(monkeypatch, tmp_path):
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    stored = "\n".join(_text(cell) for cell in code)
    assert "popularity baseline" in stored and "tested on 1 process" in stored, "stored with its outputs"
    assert any("image/png" in out.get("data", {}) for cell in code for out in cell["outputs"]), "with its plot"
    for cell in code:
        cell["outputs"] = []  # executed afresh below
    # The kernel is this interpreter (its environment), importing this checkout; it runs in a temp dir.
    monkeypatch.setenv("PATH", os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    client = nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    text = "\n".join(_text(cell) for cell in notebook.cells)

    auto = next(cell.source for cell in notebook.cells if cell.cell_type == "markdown" and "## 2. Four" in cell.source)
    assert "smallest group" not in auto and "predicted faster" in auto, "it says what auto does"
    assert "candidates (predicted ms per step by phase" in text, "the auto run shows the layouts it compared"
    assert "batch 256 per rank" in text and "batch 512 per rank" not in text, "planned for the data's batch"
    layouts = re.findall(r"TwoDSparseStrategy: (\d+) replica group\(s\) x (\d+) rank\(s\) per shard group", text)
    assert len(layouts) == 2, "both forked runs print their mesh"
    assert all(int(m) * int(s) == 4 for m, s in layouts), layouts
    assert layouts[1] == ("2", "2"), "the explicit 2x2 mesh"
    assert text.count("sharding plan") >= 2 and "row_wise" in text, "the plans are shown"

    baseline = float(re.search(r"popularity baseline\s+([0-9.]+)", text).group(1))
    rows = dict(re.findall(r"^(1 process|4 processes, auto|4 processes, 2x2)\s+([0-9.]+)\s+[0-9.]+$", text, re.MULTILINE))
    assert set(rows) == {"1 process", "4 processes, auto", "4 processes, 2x2"}, text[-3000:]
    for name, auc in rows.items():
        assert float(auc) > baseline + 0.08, (name, auc, baseline)
    test_auc = float(re.search(r"tested on 1 process: test AUC ([0-9.]+)", text).group(1))
    assert test_auc > baseline + 0.08
    assert not list(tmp_path.rglob("*.ckpt")), "the notebook writes no checkpoints"
    assert "bytes sent per training step" in text and "intra KB" in text, "the traffic per link class"
    curves = re.search(r"\{'one_process': \[([0-9., ]+)\], 'auto': \[([0-9., ]+)\], 'mesh_2x2': \[([0-9., ]+)\]\}", text)
    assert curves and all(len(group.split(",")) == 2 for group in curves.groups()), "two epochs each"
    assert any("image/png" in out.get("data", {}) for cell in notebook.cells for out in cell.get("outputs", []))
