"""Where the repository keeps what is not code: `models.yaml` and the data sets under `data/`.

Data sets (evaluation sets, training targets, cached labels) are read by recipes, evaluations and
tests from a checkout; the server reads none of them (see data/README.md).
"""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
DATA_ROOT = REPO_ROOT / "data"
