"""Shared model, data and plain-torch references of the strategy tests.

A small DLRM: dense features -> bottom ``Linear``; three embedding tables (``t_item`` is shared
by the features ``item`` and ``last_item``), sum pooling; concatenation -> top ``Linear`` ->
BCE-with-logits, the mean over the local batch. Two spellings of the same network:

* ``CollectionNet``: the tables in one ``EmbeddingBagCollection`` fed with ``SparseFeatures``;
* ``PlainNet``: plain ``nn.EmbeddingBag(mode="sum")`` attributes fed with id tensors (``[B, L]``
  for fixed-length features, 1-D ids + offsets for the variable-length ``cat``).

``LitDLRM`` wraps either net for Lightning; the references (``train_reference``) train a copy of
the unsharded net with plain torch on the concatenated global batches, no Lightning involved.

Data: sample ``i`` is a pure function of ``i``. Lightning would put a *shuffling*
``DistributedSampler`` in front of any training loader (even a sequential one), so ``LitDLRM``
sets its own with ``shuffle=False``: rank ``r`` gets the samples ``r, r + W, r + 2W, ...``, and
optimizer step ``t`` of a ``W``-process run with local batch ``b`` sees exactly the samples
``[t*b*W, (t+1)*b*W)``. The module records the sample ids of every step (``seen``) so that tests
can check this.
"""

from __future__ import annotations

import copy
import os
import socket
from abc import ABC, abstractmethod

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_twod import EmbeddingBagCollection, EmbeddingTableConfig, SparseFeatures
from lightning_twod.sparse.optimizers import SparseOptimizerConfig, sparse_update

WORLD = 4
LOCAL_BATCH = 4
DENSE_IN = 4
BOTTOM = 8

# (table, rows, dim, features)
TABLES = [
    ("t_user", 40, 8, ["user"]),
    ("t_item", 60, 8, ["item", "last_item"]),  # one table, two features
    ("t_cat", 24, 4, ["cat"]),
]
FIXED_LENGTH = {"user": 2, "item": 3, "last_item": 1}  # "cat" has 0..3 ids per sample
FEATURE_TABLE = {f: (name, rows, dim) for name, rows, dim, feats in TABLES for f in feats}
FEATURES = [f for _, _, _, feats in TABLES for f in feats]


# ----------------------------------------------------------------------------- data
class ClickDataset(Dataset):
    """``num_samples`` deterministic samples; ids lie in ``[0, rows * row_scale)`` of their table."""

    def __init__(self, num_samples: int, row_scale: int = 1, seed: int = 0) -> None:
        self.num_samples = num_samples
        self.row_scale = row_scale
        self.seed = seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> dict:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        item = {"idx": i, "dense": torch.randn(DENSE_IN, generator=gen).tolist(),
                "y": float(torch.rand((), generator=gen) < 0.4)}
        for feature in FEATURES:
            rows = FEATURE_TABLE[feature][1] * self.row_scale
            n = FIXED_LENGTH.get(feature)
            if n is None:
                n = int(torch.randint(0, 4, (), generator=gen))
            item[feature] = torch.randint(0, rows, (n,), generator=gen).tolist()
        return item


def collate(items: list[dict]) -> dict:
    """A batch in both spellings: ``sparse`` (``SparseFeatures``) and id tensors per feature."""
    batch = {
        "idx": torch.tensor([it["idx"] for it in items]),
        "dense": torch.tensor([it["dense"] for it in items]),
        "y": torch.tensor([it["y"] for it in items]),
        "sparse": SparseFeatures.from_dict({f: [it[f] for it in items] for f in FEATURES}),
    }
    for feature in FIXED_LENGTH:
        batch[feature] = torch.tensor([it[feature] for it in items], dtype=torch.int64)
    lengths = torch.tensor([len(it["cat"]) for it in items])
    batch["cat_values"] = torch.tensor([i for it in items for i in it["cat"]], dtype=torch.int64)
    batch["cat_offsets"] = torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)[:-1]])
    return batch


def global_batch(dataset: ClickDataset, step: int, size: int) -> dict:
    """The samples ``[step * size, (step + 1) * size)`` as one batch."""
    return collate([dataset[i] for i in range(step * size, (step + 1) * size)])


def emulate_epoch(emulator, steps: int, ranks: int = WORLD) -> None:
    """``steps`` steps of ``emulator`` (a ``MeshEmulator``) on the batches ``WORLD`` real ranks get from a
    sequential ``DistributedSampler`` over ``ClickDataset(steps * WORLD * LOCAL_BATCH)``, then the end of
    fit; on a mesh of one rank (``ranks=1``), each step's batch is the ranks' batches concatenated."""
    dataset = ClickDataset(steps * WORLD * LOCAL_BATCH)
    for step in range(steps):
        start = step * WORLD * LOCAL_BATCH
        batches = [[dataset[start + r + WORLD * i] for i in range(LOCAL_BATCH)] for r in range(WORLD)]
        emulator.step([collate(b) for b in batches] if ranks == WORLD else [collate(sum(batches, []))])
    emulator.drain()


# ----------------------------------------------------------------------------- nets
class _Net(nn.Module, ABC):
    def __init__(self) -> None:
        super().__init__()
        self.bottom = nn.Linear(DENSE_IN, BOTTOM)
        pooled = sum(FEATURE_TABLE[f][2] for f in FEATURES)
        self.top = nn.Linear(BOTTOM + pooled, 1)

    @abstractmethod
    def embed(self, batch: dict) -> Tensor:
        """``[B, sum of feature dims]`` pooled embeddings; the two spellings differ only here."""

    def forward(self, batch: dict) -> Tensor:
        """``[B]`` logits."""
        dense = torch.relu(self.bottom(batch["dense"]))
        return self.top(torch.cat([dense, self.embed(batch)], dim=1)).squeeze(1)

    def loss(self, batch: dict) -> Tensor:
        return nn.functional.binary_cross_entropy_with_logits(self(batch), batch["y"])


class CollectionNet(_Net):
    def __init__(self, row_scale: int = 1) -> None:
        super().__init__()
        self.sparse = EmbeddingBagCollection([
            EmbeddingTableConfig(name, rows * row_scale, dim, feats) for name, rows, dim, feats in TABLES
        ])

    def embed(self, batch: dict) -> Tensor:
        return self.sparse(batch["sparse"]).values()


class PlainNet(_Net):
    def __init__(self, row_scale: int = 1) -> None:
        super().__init__()
        for name, rows, dim, _ in TABLES:
            bag = nn.EmbeddingBag(rows * row_scale, dim, mode="sum")
            nn.init.uniform_(bag.weight, -0.2, 0.2)
            setattr(self, name, bag)

    def embed(self, batch: dict) -> Tensor:
        return torch.cat([
            self.t_user(batch["user"]),
            self.t_item(batch["item"]),
            self.t_item(batch["last_item"]),  # the shared table, called twice
            self.t_cat(batch["cat_values"], batch["cat_offsets"]),
        ], dim=1)


def make_net(kind: str = "collection", seed: int = 0, row_scale: int = 1) -> _Net:
    torch.manual_seed(seed)
    return {"collection": CollectionNet, "plain": PlainNet}[kind](row_scale)


def embedding_names(net: nn.Module) -> set[str]:
    """``state_dict`` keys of the embedding tables of an unsharded net."""
    return {f"{path}.weight" for path, m in net.named_modules() if isinstance(m, nn.EmbeddingBag)}


# ----------------------------------------------------------------------------- Lightning
class LitDLRM(pl.LightningModule):
    def __init__(self, net: _Net, lr: float, batch_size: int = LOCAL_BATCH, num_samples: int = 320,
                 row_scale: int = 1) -> None:
        super().__init__()
        self.net = net
        self.lr = lr
        self.batch_size = batch_size
        self.num_samples = num_samples
        self.row_scale = row_scale
        self.seen: list[list[int]] = []  # sample ids of every training step, this rank

    def training_step(self, batch, batch_idx):
        self.seen.append(batch["idx"].tolist())
        loss = self.net.loss(batch)
        self.log("loss", loss, batch_size=len(batch["y"]))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def train_dataloader(self):
        # Lightning's own DistributedSampler always shuffles a training loader (seeded by epoch), so
        # the sequential one is set here; Lightning keeps a DistributedSampler it is given.
        dataset = ClickDataset(self.num_samples, self.row_scale)
        sampler = DistributedSampler(dataset, self.trainer.world_size, self.trainer.global_rank, shuffle=False)
        return DataLoader(dataset, batch_size=self.batch_size, sampler=sampler, collate_fn=collate)


class NoTablesModule(pl.LightningModule):
    """A dense-only module: the strategy must refuse it."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(DENSE_IN, 1)

    def training_step(self, batch, batch_idx):
        return nn.functional.binary_cross_entropy_with_logits(self.layer(batch["dense"]).squeeze(1), batch["y"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(ClickDataset(64), batch_size=LOCAL_BATCH, collate_fn=collate)


def trainer_kwargs(steps: int, **extra) -> dict:
    return dict(accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, **extra)


# ----------------------------------------------------------------------------- plain-torch references
def train_reference(net: _Net, steps: int, global_size: int, dense_lr: float, sparse: SparseOptimizerConfig | None,
                    row_scale: int = 1) -> dict[str, Tensor]:
    """Train ``net`` (a copy; no Lightning, no strategy) on the global batches; its final state dict.

    ``sparse=None``: ``torch.optim.SGD(lr=dense_lr)`` over every parameter, tables included.
    Otherwise the dense part by SGD and each table's rows by ``sparse_update`` from its dense gradient
    (rows with a zero gradient are left unchanged by every sparse optimizer here).
    """
    net = copy.deepcopy(net)
    dataset = ClickDataset(steps * global_size, row_scale)
    tables = {n: p for n, p in net.named_parameters() if n in embedding_names(net)}
    dense = [p for n, p in net.named_parameters() if n not in tables]
    optimizer = torch.optim.SGD(net.parameters() if sparse is None else dense, lr=dense_lr)
    states = {n: torch.zeros(p.shape[0]) for n, p in tables.items()}
    for step in range(steps):
        optimizer.zero_grad()
        for p in tables.values():
            p.grad = None
        net.loss(global_batch(dataset, step, global_size)).backward()
        optimizer.step()
        if sparse is not None:
            for n, p in tables.items():
                rows = torch.arange(p.shape[0])
                sparse_update(sparse, p.data, states[n] if sparse.has_state else None, rows, p.grad)
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


# ----------------------------------------------------------------------------- copies
def copy_tensors(replicated) -> list[Tensor]:
    """The weights and optimizer states of a replicated kernel: what every copy must agree on."""
    return [*replicated.kernel.weights(), *(s for states in replicated.kernel.shard_states() for s in states.values())]


def replicas_identical(strategy) -> list[bool]:
    """Per replicated kernel: whether every copy of its weights and states is bit-identical (a collective)."""
    same = []
    for replicated in strategy._replicated:
        equal = True
        for tensor in copy_tensors(replicated):
            tensor = tensor.detach().contiguous().clone()
            copies = [torch.empty_like(tensor) for _ in range(dist.get_world_size(replicated.group))]
            dist.all_gather(copies, tensor, group=replicated.group)
            equal &= all(torch.equal(copies[0], c) for c in copies[1:])
        same.append(equal)
    return same


# ----------------------------------------------------------------------------- processes
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def as_external_rank(rank: int, world_size: int, port: int) -> None:
    """Make Lightning treat this ``run_distributed`` child as an externally launched rank (torchrun).

    Lightning then launches nothing and reuses the process group the child already has.
    """
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), NODE_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))


def numpy_state(state: dict[str, Tensor]) -> dict:
    """Picklable without shared memory (results travel through a queue from exiting children)."""
    return {k: v.detach().cpu().numpy().copy() for k, v in state.items()}
