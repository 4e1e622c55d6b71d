"""Value types every layer shares; nothing here needs a process group or Lightning.

* ``features``: ``SparseFeatures``, a keyed jagged batch of ids (TorchRec's layout);
* ``kjt``: conversion to and from TorchRec's ``KeyedJaggedTensor`` (TorchRec optional);
* ``validation``: id range and shape checks that name the feature and the fix;
* ``outputs``: ``PooledEmbeddings`` and ``JaggedEmbeddings``, what a lookup returns;
* ``shards``: where the pieces of a table live (``ShardingType``, ``Shard``, ``TableSharding``), pure Python.

Imports go to the standard library and torch only.
"""
