"""The cross-group reduction: keeps the copies of every replicated shard consistent.

* ``touched``: which rows a copy touched since the last reduction (a row mask);
* ``rounds``: one coalesced buffer per process group and round, dense or sparse per shard, in flight;
* ``wire``: what goes on the wire (fp32 rows, or bf16 / int8 changes against a reference);
* ``quantized``: the int8 round: per-row scales the copies share, error feedback;
* ``reducer``: ``ReplicaReducer``, the rounds of a model, blocking or overlapped; NaN or inf on any
  copy stops every rank with ``NonFiniteError`` before anything is averaged in;
* ``gradients``: ``sync_mode="gradients"``, the touched rows' gradients averaged before the update
  (``step_with_mean_gradients``, with the same check);
* ``verify``: ``ReplicaCheck``, a digest of every copy compared across its replicas (``verify_replicas``);
* ``schedule``: ``SyncSchedule``, when a round runs (``sync_interval``, ``sync_overlap``), when a drain
  owes one and which rounds are verified; the strategies and the emulator drive it alike.
"""

from lightning_twod.replication.gradients import reduce_sparse_gradients, step_with_mean_gradients
from lightning_twod.replication.reducer import NonFiniteError, ReplicaReducer, ReplicatedKernel
from lightning_twod.replication.schedule import SyncSchedule
from lightning_twod.replication.verify import ReplicaCheck, ReplicaMismatchError
from lightning_twod.replication.wire import WIRE_DTYPES

__all__ = ["WIRE_DTYPES", "NonFiniteError", "ReplicaCheck", "ReplicaMismatchError", "ReplicaReducer",
           "ReplicatedKernel", "SyncSchedule", "reduce_sparse_gradients", "step_with_mean_gradients"]
