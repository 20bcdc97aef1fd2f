"""scripts/gpu_real_model.sh's stages fail closed: a ``train`` stage whose train-drafter fails ends the script with
that exit code before any later stage (it returned 0, and the ``bench`` after it measured the older drafter), the
failed run leaves no recipe mark, and ``bench`` logs which flags trained the drafter it measures."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_failed_train_stage_stops_the_script_with_its_code_and_bench_names_its_drafter(tmp_path):
    work, logs = tmp_path / "work", tmp_path / "logs"
    model = work / "SmolLM2-135M-Instruct"
    (model / "dspark_drafter").mkdir(parents=True)
    (model / "model.safetensors").write_text("not a checkpoint")  # past train's guard; train-drafter refuses it
    (model / "dspark_drafter" / "recipe.txt").write_text("recipe 5: an older run's flags\n")
    (model / "dspark_drafter" / "training.json").write_text(
        '{"steps_done": 1350, "complete": true, "skipped_steps": [{"step": 1155}, {"step": 1168}]}')
    env = {**os.environ, "REAL_MODEL_WORK": str(work), "REAL_MODEL_LOGS": str(logs), "OUT": str(tmp_path / "result"),
           "BENCH_SETS": " ", "TRAIN_SECONDS": "5"}  # " ": bench logs its drafter and runs no prompt set
    r = subprocess.run(["bash", "scripts/gpu_real_model.sh", "bench", "train", "bench"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    failed = re.search(r"train: train-drafter exited (\d+);", out)
    assert failed and int(failed.group(1)) != 0, out[-3000:]
    assert r.returncode == int(failed.group(1)), out[-3000:]
    stages = [line.split()[0] for line in (logs / "timing.txt").read_text().splitlines()]
    assert stages == ["bench", "train"], stages  # the second bench never ran over the older drafter
    assert "train 0 s (rc 0)" not in (logs / "timing.txt").read_text()
    assert not (model / "dspark_drafter" / "recipe.txt").exists()  # the failed run marks nothing
    named = (logs / "drafter.txt").read_text().splitlines()
    assert named == [f"bench: the drafter in {model}/dspark_drafter (1350 steps, complete: true, skipped: 2), trained by: recipe 5: "
                     "an older run's flags"], named
    r = subprocess.run(["bash", "scripts/gpu_real_model.sh", "bench"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)  # a later call's bench: the drafter left there carries no mark now
    assert r.returncode == 0 and "bench: WARNING: " in r.stdout and "carries no recipe mark" in r.stdout, r.stdout
    folders = [p.name for p in work.glob("drafter_work*")]  # a work folder per flag set, never one per recipe
    assert all(re.fullmatch(r"drafter_work_recipe5_[0-9a-f]{8}", f) for f in folders), folders
