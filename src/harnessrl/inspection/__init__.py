"""inspect: read what a run recorded, in the terminal (`harnessrl inspect RUN_DIR`).

Modules, outside in: `cli` (arguments, exit codes, `--json`), `render` (rich tables and coloured
tokens), `report` (the index and one rollout's calls and rows as JSON-ready dicts), `runview` (the
store, the run's settings, where a rollout belongs; rows recomputed with `adapter.merge_calls`),
`tokens` (the run's tokenizer, found without importing torch), `index_file` (`rollouts/index.tsv`).
Nothing here imports torch.
"""

from __future__ import annotations

from harnessrl.inspection.cli import main
from harnessrl.inspection.index_file import write_rollout_index
from harnessrl.inspection.report import index_report, rollout_report
from harnessrl.inspection.runview import Place, RunError, rollout_place

__all__ = [
    "Place",
    "RunError",
    "index_report",
    "main",
    "rollout_place",
    "rollout_report",
    "write_rollout_index",
]
