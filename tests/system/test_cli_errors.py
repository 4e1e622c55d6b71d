"""A user's error on one rank and a bug on another, through ``lightning-twod fit`` on 2 processes: both
are printed, the user's as its one line with its rank, the bug with its traceback, whichever rank
raises which and whether each rank raised on its own or inside the strategy's consensus."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.helpers.cli_cases import write_config
from tests.helpers.failing_models import BUG, USER_ERROR
from tests.helpers.processes import child_env

TIMEOUT = 300


@pytest.mark.parametrize("user_error_rank", [0, 1])
@pytest.mark.parametrize("where", ["training_step", "configure_optimizers"])
def test_a_bug_on_one_rank_is_printed_beside_a_users_error_on_another(tmp_path, where, user_error_rank):
    config = write_config(tmp_path)
    model = ["--model=tests.helpers.failing_models.FailingDLRM", f"--model.init_args.where={where}",
             f"--model.init_args.user_error_rank={user_error_rank}"]
    fitted = subprocess.run([sys.executable, "-m", "lightning_twod", "fit", "--config", str(config), *model],
                            cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=TIMEOUT)
    err = fitted.stderr
    assert fitted.returncode != 0
    errors = [line for line in err.splitlines() if "error:" in line]
    assert errors == [f"lightning-twod fit: error: rank {user_error_rank}: {USER_ERROR}"], err[-5000:]
    assert err.count("Traceback (most recent call last)") == 1, err[-5000:]
    traceback = err[err.index("Traceback (most recent call last)"):]
    assert f"in {where}" in traceback and "in _fail" in traceback, traceback[-3000:]  # where the bug was raised
    # torch prefixes a rank's uncaught traceback with [rankN]:; the other rank's line may come after it
    assert any(re.fullmatch(rf"(\[rank\d\]: )?KeyError: '{BUG}'", line) for line in traceback.splitlines()), \
        traceback[-3000:]
