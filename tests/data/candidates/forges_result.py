"""Writes a result.json claiming success into the run dir, then exits before the harness can."""

import json
import os

body = json.dumps({"ok": True, "value": {"task_id": "small_matmul", "source_hash": "x", "accepted": True,
                                           "correct": True, "uses_pallas": True, "compiled": True}})
with open("result.json", "w") as f:
    json.dump({"body": body, "mac": "0" * 64}, f)
os._exit(0)
