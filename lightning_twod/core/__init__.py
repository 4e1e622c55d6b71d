"""Value types and rules every layer shares; nothing here needs Lightning, or a process group at import.

* ``features``: ``SparseFeatures``, a keyed jagged batch of ids (TorchRec's layout);
* ``kjt``: conversion to and from TorchRec's ``KeyedJaggedTensor`` (TorchRec optional);
* ``validation``: id range and shape checks that name the feature and the fix;
* ``outputs``: ``PooledEmbeddings`` and ``JaggedEmbeddings``, what a lookup returns;
* ``shards``: where the pieces of a table live (``ShardingType``, ``Shard``, ``TableSharding``) and
  which owner looks up which shard for which feature (``assign_slots``), pure Python;
* ``mesh``: the grid's arithmetic (``SparseParallelDims``, placements, groups per node), no torch at
  import and no process group (``distributed.groups`` builds the mesh's groups);
* ``reduction``: the cross-group reduction's rules that the planner models (``DENSE_SHARE``, ``CHUNK``),
  pure Python.

Imports go to the standard library and torch only; ``shards``, ``mesh`` and ``reduction`` import no
torch, so the planner runs without it.
"""
