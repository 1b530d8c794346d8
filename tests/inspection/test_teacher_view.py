"""The teacher's logprobs beside the student's in inspect: read from the run's teacher_logprobs.jsonl,
attached to the report's rows that were trained as they are, shown as a column of the token table."""

from __future__ import annotations

import json
from io import StringIO
from pathlib import Path

from rich.console import Console

from harnessrl.inspection.render import _token_table
from harnessrl.inspection.teacher_view import FILE, attach_teacher_logprobs, read_teacher_logprobs


def test_teacher_logprobs_join_the_rows_they_scored(tmp_path: Path) -> None:
    lines = [
        {"step": 1, "rollout_id": "r1", "call_ids": ["c1", "c2"], "teacher_logprobs": [-9.0, -9.0, -9.0]},
        {"step": 2, "rollout_id": "r1", "call_ids": ["c1", "c2"], "teacher_logprobs": [-0.5, -1.5, -2.5]},
        {"step": 2, "rollout_id": "r1", "call_ids": ["c3"], "teacher_logprobs": [-0.1]},  # a cut row: 1 of 2
        {"step": 2, "rollout_id": "r2", "call_ids": ["c9"], "teacher_logprobs": [-3.0]},
    ]
    (tmp_path / FILE).write_text(
        "".join(json.dumps(x) + "\n" for x in lines) + '{"step": 3, "rollout_id": "r1", "ca'
    )
    scored = read_teacher_logprobs(tmp_path, "r1")
    assert scored == {
        ("c1", "c2"): [-0.5, -1.5, -2.5],
        ("c3",): [-0.1],
    }  # the latest step; a torn line skipped
    rows = [
        {"tokens": [5, 6, 7, 8, 9], "pieces": list("abcde"), "loss_mask": [0, 1, 1, 0, 1], "n_trainable": 3,
         "logprobs": [0.0, -0.4, -1.0, 0.0, -3.0]},
        {"tokens": [5, 6, 7], "pieces": list("abc"), "loss_mask": [0, 1, 1], "n_trainable": 2,
         "logprobs": [0.0, -0.2, -0.3]},
    ]  # fmt: skip
    attach_teacher_logprobs(rows, [["c1", "c2"], ["c3"]], scored)
    assert rows[0]["teacher_logprobs"] == [None, -0.5, -1.5, None, -2.5]
    assert "teacher_logprobs" not in rows[1]
    out = StringIO()
    Console(file=out, width=120).print(_token_table(rows[0]))
    table = out.getvalue().splitlines()
    assert "teacher" in table[0] and table[2].split()[-2:] == ["-0.4000", "-0.5000"]
    assert read_teacher_logprobs(tmp_path / "none", "r1") == {}
