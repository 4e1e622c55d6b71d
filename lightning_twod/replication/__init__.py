"""The cross-group reduction: keeps the copies of every replicated shard consistent.

* ``touched``: which rows a copy touched since the last reduction (a row mask);
* ``rounds``: one coalesced buffer per process group and round, dense or sparse per shard, in flight;
* ``wire``: what goes on the wire (fp32 rows, or bf16 / int8 changes against a reference);
* ``quantized``: the int8 round: per-row scales the copies share, error feedback;
* ``reducer``: ``ReplicaReducer``, the rounds of a model, blocking or overlapped;
* ``gradients``: ``sync_mode="gradients"``, the touched rows' gradients averaged before the update;
* ``verify``: ``ReplicaCheck``, a digest of every copy compared across its replicas (``verify_replicas``).
"""

from lightning_twod.replication.gradients import reduce_sparse_gradients
from lightning_twod.replication.reducer import ReplicaReducer, ReplicatedKernel
from lightning_twod.replication.verify import ReplicaCheck, ReplicaMismatchError
from lightning_twod.replication.wire import WIRE_DTYPES

__all__ = ["WIRE_DTYPES", "ReplicaCheck", "ReplicaMismatchError", "ReplicaReducer", "ReplicatedKernel",
           "reduce_sparse_gradients"]
