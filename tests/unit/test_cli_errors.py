"""What a rank prints of an error (``cli.errors``), in one process: its own exception where the
consensus joined several ranks' errors, nothing where it raised none, and which errors are the loss
of a peer (``consensus.lost_peer``). The runs of 2 processes are in ``tests/system/test_cli_errors.py``."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from lightning.fabric.utilities.exceptions import MisconfigurationException

from lightning_twod.cli.errors import run_reporting_errors
from lightning_twod.distributed.consensus import lost_peer, own_error

GLOO_PEER_GONE = ("[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                  "[127.0.0.1]:24232. This is typically caused by a remote worker crashing.")


def _joined(own: BaseException | None) -> MisconfigurationException:
    """What ``raise_on_every_rank`` raises on a rank when rank 0 raised a user's error and rank 1 a bug:
    rank 0's type, every rank's message, and this rank's own exception (``rank_error``)."""
    joined = MisconfigurationException("set-up failed on rank(s) [0, 1] of 2: rank 0: bad; rank 1: 'k'")
    joined.raised_on_every_rank = True
    joined.rank_error = own
    return joined


def _raising(err: BaseException):
    def run():
        raise err
    return run


@pytest.mark.parametrize(("err", "lost"), [
    (RuntimeError(GLOO_PEER_GONE), True),
    (RuntimeError("[pair.cc:598] Connection reset by peer"), True),
    (RuntimeError("Timed out waiting 1800000ms for recv operation to complete"), True),
    (dist.DistNetworkError("failed to recv, got 0 bytes"), True),
    (dist.DistStoreError("wait timeout after 5000ms"), True),
    (RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:538] Write error [127.0.0.1]:5123: Broken pipe"),
     True),
    (RuntimeError("NCCL communicator was aborted on rank 3."), True),
    (RuntimeError("Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, OpType=ALLREDUCE) ran for "
                  "600000 milliseconds before timing out."), True),
    (RuntimeError("NCCL error: remote process exited or there was a network error"), True),
    (RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 5x8)"), False),
    (RuntimeError("DataLoader timed out after 30 seconds"), False),  # the rank's own loader, not a peer
    (RuntimeError("HTTPConnectionPool(host='data', port=80): connection refused"), False),
    (KeyError("closed by peer"), False),  # not what a collective raises
    (MisconfigurationException("bad"), False),
])
def test_the_loss_of_a_peer_is_told_from_a_ranks_own_error(err, lost):
    assert lost_peer(err) is lost


def test_own_error_is_what_this_rank_raised():
    bug = KeyError("k")
    assert own_error(bug) is bug
    assert own_error(_joined(bug)) is bug
    assert own_error(_joined(None)) is None


def test_a_ranks_own_bug_keeps_its_traceback_where_the_consensus_joined_it_with_a_users_error(capsys):
    def configure_optimizers():
        raise KeyError("k")

    try:
        configure_optimizers()
    except KeyError as err:
        bug = err
    with pytest.raises(KeyError) as raised:
        run_reporting_errors("fit", _raising(_joined(bug)))
    assert raised.value is bug and raised.value.__suppress_context__  # the bug itself, not the joined error
    assert "configure_optimizers" in {frame.name for frame in raised.traceback}
    assert capsys.readouterr().err == ""


def test_a_ranks_own_users_error_is_printed_with_its_rank(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as exited:
        run_reporting_errors("fit", _raising(_joined(FileNotFoundError("no file data.tsv"))))
    assert exited.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("lightning-twod fit: error: rank 1: no file data.tsv\n") and "rank 0" not in err


def test_a_rank_that_raised_nothing_prints_nothing(capsys):
    with pytest.raises(SystemExit) as exited:
        run_reporting_errors("fit", _raising(_joined(None)))
    assert exited.value.code == 1 and capsys.readouterr().err == ""


def test_the_loss_of_a_peer_keeps_its_traceback_when_no_rank_reported(capsys):
    with pytest.raises(RuntimeError, match="Connection closed by peer"):  # no store: nobody said why
        run_reporting_errors("fit", _raising(RuntimeError(GLOO_PEER_GONE)))
